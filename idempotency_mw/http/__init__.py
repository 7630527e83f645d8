"""The ASGI entry: the middleware, one keyed request, the routes, OpenAPI and the lookup."""
