"""The REST API, written once for the server and the hub broker.

``input`` reads request bodies, ``views`` shapes leases and devices for the caller, ``openapi``
is the document both serve, ``routes`` holds the URL patterns and header names, ``events`` shapes
arbiter events for one viewer, and ``handlers`` holds the handlers themselves. The server and the
broker each add only who is asking (an identity hook) and which kernels they may touch.
"""
