"""Portable column types shared by the server's table and the client's journal table."""

from __future__ import annotations

from sqlalchemy import LargeBinary, String
from sqlalchemy.dialects import mysql

#: Case-sensitive text: MySQL/MariaDB compare strings case-insensitively by default.
ExactString = String(255).with_variant(
    mysql.VARCHAR(255, collation="utf8mb4_bin"), "mysql", "mariadb"
)
#: Bytes of any size: a plain BLOB holds only 64 KiB on MySQL/MariaDB.
LongBinary = LargeBinary().with_variant(mysql.LONGBLOB(), "mysql", "mariadb")
