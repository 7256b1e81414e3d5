"""Sans-I/O wire rules of HTTP/1.1 at the relay's two edges: bytes in, decisions out.

- `fields`: header fields as received and the lookups every rule uses
- `request_framing`: whether a request head frames its body unambiguously (smuggling)
- `request_path`: the normalised path a request really names (what the upstream routes on)
- `response_head`: the upstream's response head, read by a strict parser held to h11
- `response_framing`: how an upstream body is delimited and carried to the client
- `chunked`: the chunked coding, followed in passing and written
- `to_upstream`: the request the relay writes upstream (which headers cross, what is added)
- `to_client`: the heads and whole answers the relay writes to the client
- `upstream_url`: an `[[upstream]].url`: address, Host, path prefix, the target sent
- `tls`: the TLS context towards https upstreams, and a TLS failure in words

May import: `relay.errors`. Nothing here touches a socket, a loop or a clock.
"""
