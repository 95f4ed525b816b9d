"""What the node side and the master say to each other: typed interfaces and domain types.

`dlrover.api.master` (`MasterApi`) and `dlrover.api.sharding` (`ShardingTransport`,
`StreamTransport`) are the one source of every RPC; `dlrover.api.rpc` derives each call's
messages, client methods and error convention from them with the reflective mapper of
`dlrover.api.mapper`, and `dlrover.api.wire` holds the master's table of them. Both sides
import this package; it imports neither side.
"""
