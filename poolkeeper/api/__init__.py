"""The worker protocol over HTTP (``app.create_app``): the routes pool workers call, and the probes."""
