"""The serving side: the rollout server (`emapg rollout serve`) with its weight staging and request limits, the
OpenAI-compatible endpoint (wire, service, routes), and the bounded HTTP server every emapg server runs on.
The contract both ends share (engines/rollout_protocol.py) sits below, in engines/,
beside its client `RemoteEngine`; the one-request HTTP client is the floor-0 `http_client.py`."""
