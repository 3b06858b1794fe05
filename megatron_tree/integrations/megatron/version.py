"""Which megatron-core this integration was written against, and the check every entry point makes.

Invariant: every piece that touches megatron-core's inference internals (the core attention,
the static and dynamic contexts, the source patches) refuses any release but the ones listed
here, with an error saying what was found and what was expected. A module of its own so that
the patches and the contexts share it without importing each other.
"""

from __future__ import annotations

__all__ = ["SUPPORTED_VERSIONS", "megatron_version", "check_megatron_version"]

SUPPORTED_VERSIONS = ("0.16.1",)
"""megatron-core releases whose inference internals this package and ``patches/`` were written against."""


def megatron_version() -> str:
    """Version of the megatron-core that is imported (``megatron.core.package_info``)."""
    from megatron.core import package_info

    return package_info.__shortversion__


def check_megatron_version(what: str) -> str:
    """Raise ``RuntimeError`` naming ``what`` unless the imported megatron-core is supported."""
    version = megatron_version()
    if version not in SUPPORTED_VERSIONS:
        raise RuntimeError(
            f"{what} supports megatron-core {', '.join(SUPPORTED_VERSIONS)}, but {version} is imported; "
            "its inference internals differ (0.19 rejects CP != 1 at inference), so refusing rather than "
            "guessing. Pin megatron-core==0.16.1 or port patches/ to the new release."
        )
    return version
