"""What the node side and the master say to each other, in domain types (no protobuf).

`dlrover.api.master` holds the types and the `MasterApi` Protocol; `dlrover.api.wire` converts
them to and from the gRPC messages. Both sides import this package; it imports neither side.
"""
