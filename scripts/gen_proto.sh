#!/usr/bin/env bash
# Regenerate the checked-in gRPC/protobuf code from dlrover/proto/*.proto.
# Needs grpcio-tools (in the `test` extra). Run from anywhere: scripts/gen_proto.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. \
    dlrover/proto/master.proto dlrover/proto/embedding.proto
echo "regenerated dlrover/proto/{master,embedding}_pb2{,_grpc}.py and their .pyi"
