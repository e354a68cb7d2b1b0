"""Protobuf messages generated from the repository's ``proto/`` (see
``sluice_client._codegen``). Import them through ``sluice_client.proto``."""
