"""Serving: request handling and streaming replies (service), the Triton Python-backend adapter
(triton_model), the client for a running server (client) and a local CPU tritonserver
(local_server). Imports the rest of the runtime and treeflash_export, never the other way."""
