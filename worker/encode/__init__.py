"""The encode role (`python -m worker --role encode`): an HTTP server that loads and checks image parts, keeps
their rows in a registered region until a prefill worker pulls them, and answers with metadata only.

    app     the encode worker's HTTP server: POST /v1/encode, POST /v1/embeds/pull, GET /health
    store   the rows waiting to be pulled, freed once pulled or after a timeout
    serve   starting it from the worker's command line (and registering it in etcd)

The rows' region, the metadata it answers with and the prefill side's pull are worker/multimodal's.
"""
