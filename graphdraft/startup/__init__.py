"""Start-up: compiling a schedule's Triton kernels before capture, in this process or in workers.

A cold `capture_graphs` spends most of its time in Triton's compiler. This package runs that
work before (or beside) the capture, and leaves a warm marker so a later start skips it. It
sits above `kernels/`, `models/` and `runtime/` and below `serving/`: it never imports the
serving layer; an engine it rebuilds comes from a factory named in its `WorkerSpec`
("module:function", by default the engine's own class).

| module | what it holds |
|---|---|
| `forwards.py` | the one list of an engine's captured forwards (`engine.graph_registry` order) and the tasks over them |
| `probes.py` | the eager prefill steps a precompile runs so the first requests compile nothing |
| `spec.py` | `WorkerSpec` (an engine's shapes), the engine factory, the reduced target, the default worker count, memory bounds |
| `entries.py` | a plan entry: one specialization key as data (`encode_arg` / `decode_arg`) |
| `plan.py` | `plan_keys`: the dry runs on throw-away engines, one entry per distinct key |
| `compile.py` | compiling an entry without a launch, claims between processes, the launcher and compile-target hooks |
| `workers.py` | the worker server and its worker processes (`python -m graphdraft.startup.workers DIR N`) |
| `marker.py` | the warm-cache marker and the cost-table path |
| `phase.py` | the worker phase (`start_workers`, `CompilePhase`, `WorkerReport`) |
| `warmup.py` | what the Engine calls: `precompile_engine`, `start_precompile`, `finish_precompile`, `worker_report` |

Nothing is imported here, so `python -m graphdraft.startup.workers` runs its module once.
"""
