"""Generated from proto/pdserve/v1/pdserve.proto by `make proto`: never edit these modules by hand.

`pdserve_pb2` holds the messages, `pdserve_pb2_grpc` the service's stub and servicer base.
"""
