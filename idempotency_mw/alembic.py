"""For your own Alembic project's env.py: our table's metadata and two hooks.

``target_metadata = [Base.metadata, idempotency_mw.alembic.metadata]`` lets autogenerate
compare our table too; :func:`include_object` keeps it from ever proposing to drop our tables;
:func:`process_revision_directives` refuses a revision that would be written into this package
or onto its branch. The README's "Migrations" section has the whole recipe.
"""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Any

from idempotency_mw.engine.proofs import PROOF_TABLE, proof_metadata
from idempotency_mw.stores.sql.schema import (
    PROOF_VERSION_TABLE,
    TABLE_NAME,
    VERSION_TABLE,
    metadata,
)

if TYPE_CHECKING:
    from alembic.operations.ops import MigrationScript
    from alembic.runtime.migration import MigrationContext

__all__ = [
    "BRANCH_LABEL",
    "PROOF_VERSION_LOCATION",
    "PROOF_VERSION_TABLE",
    "VERSION_LOCATION",
    "VERSION_TABLE",
    "include_object",
    "metadata",
    "process_revision_directives",
    "proof_metadata",
]

#: The branch label of the packaged revisions: ``alembic upgrade idempotency_mw@head``.
BRANCH_LABEL = "idempotency_mw"
#: The ``version_locations`` entry that adds the packaged revisions to your project.
VERSION_LOCATION = "idempotency_mw:migrations/versions"
#: The ``version_locations`` entry of the proof table ``fence()`` writes when the store is on
#: another database (branch ``idempotency_mw_proofs``).
PROOF_VERSION_LOCATION = "idempotency_mw:migrations/proofs"

_OUR_TABLES = frozenset({TABLE_NAME, PROOF_TABLE, VERSION_TABLE, PROOF_VERSION_TABLE})


def include_object(
    object_: Any, name: str | None, type_: str, reflected: bool, compare_to: Any
) -> bool:
    """Alembic's ``include_object`` hook: leave out our tables when only the database has them.

    So autogenerate and ``alembic check`` never propose to drop ``idempotency_records`` (when
    your ``target_metadata`` leaves it out) or ``idempotency_mw_alembic_version``. A table in
    your ``target_metadata`` is compared as usual.
    """
    return not (type_ == "table" and reflected and compare_to is None and name in _OUR_TABLES)


def _versions_folders() -> set[Path]:
    migrations = files("idempotency_mw") / "migrations"
    return {Path(str(migrations / name)).resolve() for name in ("versions", "proofs")}


class _RefusedVersionPath(os.PathLike[str]):
    """A version path that fails as soon as Alembic turns it into a path, which it does only
    to write a revision: ``alembic check``, which writes nothing, goes through untouched."""

    def __init__(self, message: str) -> None:
        self.message = message

    def __fspath__(self) -> str:
        from alembic.util import CommandError

        raise CommandError(self.message)


def process_revision_directives(
    context: MigrationContext, revision: Any, directives: list[MigrationScript]
) -> None:
    """Alembic's ``process_revision_directives`` hook: refuse to write a revision into this
    package's versions folder or onto its branch.

    Without ``--head``, a project's first revision is based on the only head there is, ours,
    and written beside it, inside the installed package: lost on the next install, and on our
    branch. ``alembic revision`` then fails with a message naming the right commands, and
    writes nothing.
    """
    from alembic.script import Script
    from alembic.script.revision import RevisionError

    script_directory = context.script
    if script_directory is None:
        return
    ours = _versions_folders()
    for directive in directives:
        try:
            parents = script_directory.revision_map.get_revisions(directive.head or "head")
        except RevisionError:  # several heads and no --head: Alembic says so itself
            continue
        on_our_branch = any(
            Path(parent.path).resolve().parent in ours
            for parent in parents
            if isinstance(parent, Script)
        )
        into_package = (
            directive.version_path is not None and Path(directive.version_path).resolve() in ours
        )
        if on_our_branch or into_package:
            # Alembic accepts any os.PathLike here, though it annotates the attribute as str.
            directive.version_path = _RefusedVersionPath(  # type: ignore[assignment]
                "idempotency-mw: this revision would be written into "
                f"{' or '.join(sorted(map(str, ours)))} (the installed package) or onto its "
                "branch; give your revisions a branch of your own: "
                "the first with `alembic revision --autogenerate --head base --branch-label app "
                "--version-path alembic/versions -m ...`, later ones with `--head app@head`"
            )
