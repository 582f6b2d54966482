"""``infer-worker bench``: the model benchmark (``--model``) and the tuning sweep
(``--sweep``), one module per job, read top to bottom in this order:

- ``options``: ``bench --model``'s options and the worker settings per model
- ``payloads``: the images each model's requests carry, as records
- ``backlog``: how many records make a drain of at least ten seconds
- ``engine``: the worker's engine alone, on its largest batch
- ``drain``: ``run --procs N`` draining the backlog, scored over its steady state
- ``openloop``: Poisson arrivals at a rate, their latencies and stages
- ``report``: names, the summary's table and its results file
- ``modelbench``: ``bench --model`` from start to end
- ``recommend``: the sweep's rule (pure) and the lines it prints
- ``sweep``: ``bench --sweep`` from start to end; ``sweep_report``: its outputs

The ingest ceiling (a bare consumer) is ``worker.bench.ceiling``, shared with the
repository's ``benchmarks/`` scripts.
"""
