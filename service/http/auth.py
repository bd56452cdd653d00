"""Bearer-token authentication for /v1 routes, on when SWITCHYARD_API_KEY is set."""

from __future__ import annotations

import hmac

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from service.errors import Unauthorized

# auto_error=False: we raise our own 401 problem (HTTPBearer's default answers 403 on a missing header).
bearer_scheme = HTTPBearer(auto_error=False, description="Required when SWITCHYARD_API_KEY is set.")


async def require_api_key(
    request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(bearer_scheme)
) -> None:
    key = request.app.state.switchyard.settings.server.api_key
    if key is None:
        return
    challenge = {"WWW-Authenticate": 'Bearer realm="switchyard"'}
    if credentials is None:
        raise Unauthorized("missing 'Authorization: Bearer <key>' header", field="Authorization", headers=challenge)
    if not hmac.compare_digest(credentials.credentials.encode(), key.get_secret_value().encode()):
        raise Unauthorized("the bearer token is not valid", field="Authorization", headers=challenge)
