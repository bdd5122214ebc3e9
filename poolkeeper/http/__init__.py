"""What the servers share: refusals as JSON, the middlewares, the guarded transport, serving."""
