"""The generation API client (a published interface): talks to SGLang or the embedded server."""
from .admin import AdminClient, AdminError, server_load  # noqa: F401
from .generate import (  # noqa: F401
    GenerationClient,
    GenerationError,
    GenerationResult,
    ServerRef,
    parse_version,
)
