"""Starting and stopping a serving stack's processes, for tests, benchmarks, the fault campaign and examples.

    serving.py         one process supervisor (`Process`), `free_port`, `wait_healthy`, the worker and proxy
                       command lines, and our stacks: DI 1P1D, two colocated workers, one `both` worker
    vllm.py            stacks of `vllm serve` processes: plain, 1P1D with NixlConnector or NeuronConnector
    vllm_readme.py     the vLLM 1P1D commands of docs/vllm.md (prefill, decode, proxy), to run them as a user would
    epd.py             an encode, a prefill and a decode worker behind the proxy, and a `both` worker beside
    etcd.py            a real etcd on free ports (EtcdServer), and its command line for stacks that restart it
    worker_metrics.py  what a running worker's /metrics says: KV blocks in use, a wait until they are free

Every process runs in its own session and is stopped (SIGTERM, then SIGKILL) on the way out, also when
start-up fails or the run is interrupted; every wait has a deadline. Imports nothing of ours but `common`.
"""
