"""The planner: sets how many prefill and decode workers run, from live figures, within a budget.

    python -m planner --etcd HOST:PORT --proxy-url URL --ttft-target-ms N --itl-target-ms N --budget N ...

    config.py        the targets, the budget and the rules' settings, checked up front (a bad one names its flag)
    figures.py       the live figures of one interval: TTFT/ITL percentiles, each role's load and measured speed
    scrape.py        Prometheus text in, samples out; percentiles from histogram buckets
    observe.py       reads the proxy's and the workers' /metrics into figures (None, with why, when missing or stale)
    decide.py        the decision: figures in, target counts out (pure: hysteresis, cool-down, min/max, budget)
    fleet.py         the workers that run: etcd records, and the members a connector is changing
    actions.py       from the fleet and the target, which workers to flip, start or stop (pure)
    state.py         what survives a restart of the planner: last change, workers it started, changes under way
    loop.py          every interval: observe, decide, act through a connector, log
    connectors/      local (processes and role flips on this host), kubernetes (Deployments' replicas)

It imports nothing of ours but `common`.
"""
