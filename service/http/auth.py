"""Bearer-token authentication for /v1 routes, on when SWITCHYARD_API_KEY is set: one check, used by the
FastAPI dependency below and by the express layer (service/http/express.py)."""

from __future__ import annotations

import hmac

from fastapi import Depends, Request
from fastapi.security import HTTPBearer

from service.errors import Unauthorized
from service.settings import Settings

# auto_error=False: we raise our own 401 problem (HTTPBearer's default answers 403 on a missing header). Declared
# for the OpenAPI document; the check reads the header itself.
bearer_scheme = HTTPBearer(auto_error=False, description="Required when SWITCHYARD_API_KEY is set.")
CHALLENGE = {"WWW-Authenticate": 'Bearer realm="switchyard"'}


def check_bearer(key: bytes | None, authorization: bytes | None) -> None:
    """Raise a 401 problem unless `authorization` is `Bearer <key>` (any key when `key` is None)."""
    if key is None:
        return
    scheme, _, token = (authorization or b"").partition(b" ")
    if scheme.lower() != b"bearer" or not token:
        raise Unauthorized("missing 'Authorization: Bearer <key>' header", field="Authorization", headers=CHALLENGE)
    if not hmac.compare_digest(token, key):
        raise Unauthorized("the bearer token is not valid", field="Authorization", headers=CHALLENGE)


def api_key(settings: Settings) -> bytes | None:
    """The configured key as bytes, or None when the API is open."""
    key = settings.server.api_key
    return key.get_secret_value().encode() if key is not None else None


async def require_api_key(request: Request, _: object = Depends(bearer_scheme)) -> None:
    authorization = request.headers.get("authorization")
    check_bearer(api_key(request.app.state.switchyard.settings), authorization.encode("latin-1")
                 if authorization is not None else None)
