"""The claim engine every entry shares: claim, lease, settle, wait, fence, fingerprint."""
