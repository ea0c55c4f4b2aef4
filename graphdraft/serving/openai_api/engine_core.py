"""The engine-core process: it owns the `Engine`, steps it, and talks to the HTTP process.

`run_engine_core(spec, sock)` is the process's entry point (started by
`engine_client.EngineClient` with multiprocessing's spawn context). It builds the Engine by
calling `spec.factory` (a 'module:function' name) with `spec.args`, sends ("ready", info)
(the Engine's limits, its process id, the factory's info), then runs `EngineCore.run`:

  loop: read every command that arrived (without waiting while the Engine has work; idle,
        it sleeps in `select` until a command comes) and apply it: add requests (held,
        see below), abort them, begin the shutdown, exit; hand the held requests to the
        Engine when `admit_now` says so; one `Engine.step()`; collect the new token ids and
        finish reasons of the requests whose output changed; send them in ONE ("out",
        outputs, state) message.

Admission grouping (`admission_group` D, `graphdraft serve --admission-group`): a step that
admits requests is the Engine's eager prefill / mixed step, many times the cost of a
graph-replayed decode cycle, and it costs about the same for one new prompt as for several.
Over HTTP, successors arrive one by one as their clients' round trips end, so each would get
a mixed step of its own. The core therefore holds requests that arrive while the Engine is
only decoding, and hands them over together once ceil(running / D) are held, or once the
oldest has waited as many decode steps as one mixed step costs (`EngineCore.hold_steps`: the
ratio of the two step times the core measured, 1 to MAX_HOLD_STEPS; 1 before both were
measured), or at once when nothing runs or the next step is a prefill / mixed step anyway
(`admit_now`). So a held request waits at most about one mixed step's time (the cost that
admitting it alone would put on every running request), and trickling arrivals share one
mixed step. D = 0: every request goes to the Engine at once (the default is 8).

An output is (rid, new ids, finish reason or None, the ids' (logprob, top) pairs or None,
the prompt's scores or None): a request that asked `prompt_logprobs` gets its prompt's
(logprob, rank, top) per token (the first: (None, None, [])) once, in the output where
every prefill chunk has been scored (no later than its first token).

Several HTTP processes (`graphdraft serve --api-server-count N`): the core serves one socket
per HTTP process (`Peer`), each with its own request ids. Inside the core a request is keyed
`rid * len(peers) + peer index` (one peer: the rid itself); every peer gets its own requests'
outputs and the same engine state (but `finished`: its own requests' finishes). Socket 0 is
the owner's (the process that started the core): its ("exit",) or its end of stream ends the
core, and the "log" messages go to it. Another peer's ("exit",) or end of stream closes that
peer: its requests are aborted, the others go on. ("shutdown", grace_s) sets the deadline of
the peer that sent it.

The socket never blocks the loop: when the HTTP process has not read the last message yet,
the next steps' outputs are merged (per request) and sent as one message once the socket
takes it, so the Engine steps at its own pace whatever the HTTP side does. The engine state
for /metrics (`metrics.EngineState` fields) rides along every STATE_INTERVAL_S while busy
and once when the Engine turns idle. Every FOLD_INTERVAL_S, and when the Engine turns idle,
the Engine's accept lengths and graph use are folded into the state and its recorder reset (a long-running server's memory
stays flat).

Where the core's time goes (`CoreTimes`): seconds in each part of a turn (the idle wait for
a command, reading commands, the held requests' hand-over, `step()` split into prefill / mixed
and decode steps, collecting outputs, folding, sending) and per request the time from its
arrival here to its hand-over to the Engine and to its first token ids collected; written as
JSON to the path in $GRAPHDRAFT_CORE_TIMES (unset: kept, not written) every FOLD_INTERVAL_S
while busy and when the process ends (`perf.serve --core-times` reads it per level).

A step that raises: a request the Engine flagged (`Engine.step`'s ValueError) ends with
finish reason "error", the others go on; any other exception ends every live request with
"error" (their pages go back) and its traceback goes to the server's log ("log" message);
the process serves on. Torch's CPU threads here leave one CPU to the HTTP process (unless
OMP_NUM_THREADS says otherwise): its busy-waiting threads on every CPU would slow the HTTP
process, and with it the whole server, on a machine with few CPUs. SIGINT and SIGTERM are
ignored here (a Ctrl-C in a terminal reaches
both processes; the HTTP process shuts this one down); a watchdog ends the process when its
parent is gone, and the loop ends when the socket closes.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import selectors
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from graphdraft.serving.openai_api.wire import FrameReader, Outbox, PeerGone, encode
from graphdraft.serving.verify import SamplingParams

ADMISSION_GROUP_DEFAULT = 8
"""`EngineCoreSpec.admission_group`'s default (`admit_now`): with at most 8 running, nothing is
held; above, up to ceil(running / 8) arrivals share one mixed step. Chosen from an A/B on one
H100 (perf/RESULTS.md, 2026-12-07d: c = 128 served 1.23x (one HTTP process) and 1.31x (four)
the tokens/s of D = 0)."""
MAX_HOLD_STEPS = 8
"""The most decode steps a held request waits (`EngineCore.hold_steps`)."""
STEP_COST_EMA = 0.2
"""Weight of the newest step in the core's running means of mixed and decode step times."""
FOLD_INTERVAL_S = 0.5
STATE_INTERVAL_S = 0.05
IDLE_WAIT_S = 0.25
PARENT_CHECK_S = 0.5


CORE_TIMES_ENV = "GRAPHDRAFT_CORE_TIMES"


class CoreTimes:
    """Cumulative seconds per part of `EngineCore.turn` (`PARTS`), turn and step counts, and
    per request the sums (and counts) of arrival -> hand-over and arrival -> first ids
    collected (module docstring). `write()` writes them to `path` as JSON (None: nothing)."""

    PARTS = ("idle_wait", "receive", "admit", "step_mixed", "step_decode", "collect", "fold",
             "send")

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.seconds = dict.fromkeys(self.PARTS, 0.0)
        self.counts = {"turns": 0, "steps_mixed": 0, "steps_decode": 0, "sends_deferred": 0}
        self.requests = {"arrival_to_engine_s": 0.0, "arrival_to_first_ids_s": 0.0,
                         "handed_over": 0, "first_ids": 0}
        self.arrived: dict[int, float] = {}  # rid -> arrival (perf_counter), until first ids

    def add(self, part: str, since: float) -> float:
        """Add the seconds from `since` to now to `part`; returns now."""
        now = time.perf_counter()
        self.seconds[part] += now - since
        return now

    def write(self) -> None:
        if self.path is None:
            return
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"seconds": self.seconds, "counts": self.counts,
                       "requests": self.requests}, f)
        os.replace(tmp, self.path)


class EngineBuildError(Exception):
    """Raised by an engine factory for an error the user can fix (a bad flag or checkpoint):
    its message is one line naming what is wrong."""


@dataclass(frozen=True)
class EngineCoreSpec:
    """How the engine-core process builds its Engine (picklable: plain data only)."""

    factory: str
    """'module:function', called in the engine process as `function(args)`; returns
    (engine, info): the Engine and a dict of plain data for the HTTP process (the CLI's
    factory sends stop_token_ids, tokenizer_dir and device)."""
    args: Any
    """The factory's argument, e.g. the command line's argparse.Namespace."""
    admission_group: int = ADMISSION_GROUP_DEFAULT
    """D of the admission grouping (module docstring, `admit_now`); 0: no hold."""


def admit_now(held: int, waited_steps: int, running: int, mixed_anyway: bool,
              group: int, hold_steps: int = 1) -> bool:
    """Whether the `held` requests (> 0) go to the Engine before its next step: always when
    `group` (D) is 0, nothing is `running` (no decode cycle to wait behind), the next step is
    a prefill / mixed one anyway (`mixed_anyway`: the Engine has requests waiting or
    prefilling), the oldest has `waited_steps` >= `hold_steps` (>= 1), or `held` >=
    ceil(running / D); else they wait another decode step for more to join them."""
    if group < 0:
        raise ValueError(f"admission_group: expected an int >= 0, got {group}")
    if hold_steps < 1:
        raise ValueError(f"hold_steps: expected an int >= 1, got {hold_steps}")
    return (group == 0 or running == 0 or mixed_anyway or waited_steps >= hold_steps
            or held >= -(-running // group))


def resolve_factory(name: str) -> Callable[[Any], tuple[Any, dict]]:
    module, _, function = name.partition(":")
    if not module or not function:
        raise ValueError(f"factory: expected 'module:function', got {name!r}")
    return getattr(importlib.import_module(module), function)


def run_engine_core(spec: EngineCoreSpec, socks: list[socket.socket]) -> None:
    """The engine-core process: build the Engine, say ready (or why not) on every socket
    (`socks[0]`: the owner's), serve until the owner says exit or is gone."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    watch_parent(os.getppid())
    leave_a_cpu()
    try:
        engine, info = resolve_factory(spec.factory)(spec.args)
    except BaseException as e:  # noqa: BLE001 (the HTTP process says why)
        user = isinstance(e, (EngineBuildError, ValueError))
        message = str(e) if user else f"{type(e).__name__}: {e}"
        failed = ("failed", message, "user" if user else "internal",
                  "" if user else traceback.format_exc())
        for sock in socks:
            _send_now(sock, failed)
        return
    ready = dict(info, pid=os.getpid(), limits=asdict(engine.limits))
    if not _send_now(socks[0], ("ready", ready)):
        return
    for sock in socks[1:]:
        _send_now(sock, ("ready", ready))  # (a peer gone already is closed by the loop)
    EngineCore(engine, socks, spec.admission_group).run()


def _send_now(sock: socket.socket, message: Any) -> bool:
    try:
        sock.sendall(encode(message))
    except OSError:
        return False
    return True


def leave_a_cpu() -> None:
    """Torch's intra-op threads: at most the CPUs this process may use less one (the HTTP
    process's), unless the environment sets OMP_NUM_THREADS (public: perf.serve's offline
    baseline runs its Engine with the same threads)."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, min(torch.get_num_threads(), (cpus or 1) - 1)))


def watch_parent(ppid: int) -> None:
    """End this process (at once) when the process that started it is gone."""
    def watch() -> None:
        while os.getppid() == ppid:
            time.sleep(PARENT_CHECK_S)
        os._exit(1)
    threading.Thread(target=watch, name="graphdraft-parent-watch", daemon=True).start()


class Peer:
    """One HTTP process's socket: its reader and outbox, the selector events asked for it,
    its shutdown deadline and its requests' finishes (module docstring)."""

    def __init__(self, sock: socket.socket, index: int) -> None:
        self.sock, self.index = sock, index
        sock.setblocking(False)  # the loop never waits on one peer
        self.reader, self.outbox = FrameReader(sock), Outbox(sock)
        self.events = selectors.EVENT_READ
        self.deadline: float | None = None
        self.finished = 0
        self.open = True
        self.owes_state = False  # a state was due while its last message was being written


class EngineCore:
    """The step loop of the module docstring over `engine` and the sockets `socks` (one per
    HTTP process; one socket alone is taken as a list of one)."""

    def __init__(self, engine: Any, socks: socket.socket | list[socket.socket],
                 admission_group: int = ADMISSION_GROUP_DEFAULT) -> None:
        admit_now(1, 0, 0, False, admission_group)  # ValueError for a bad group
        if isinstance(socks, socket.socket):
            socks = [socks]
        self.engine, self.admission_group = engine, admission_group
        self.peers = [Peer(sock, i) for i, sock in enumerate(socks)]
        self.selector = selectors.DefaultSelector()
        for peer in self.peers:
            self.selector.register(peer.sock, peer.events, peer)
        # keys: rid * len(peers) + peer index (`key`)
        self.live: dict[int, list] = {}       # key -> [Request, ids sent, prompt scores sent]
        self.held: dict[int, tuple] = {}      # key -> (prompt, fields, seed stream, step held at)
        self.outputs: dict[int, list] = {}    # key -> [new ids, finish, lps, prompt] not sent
        self.exiting = False
        self.finished = self.steps = self.step_errors = 0
        self.accept_hist: dict[int, int] = {}
        self.graphs: dict[str, tuple[int, int]] = {}
        self.last_fold = self.last_state = 0.0
        self.steps_folded = 0
        self.dirty = True  # the state changed since it was last sent
        self.times = CoreTimes(os.environ.get(CORE_TIMES_ENV))
        self.step_cost: dict[str, float | None] = {"mixed": None, "decode": None}
        """Running means (`STEP_COST_EMA`) of the mixed and decode steps' seconds here."""

    @property
    def hold_steps(self) -> int:
        """How many decode steps a held request waits at most (`admit_now`): one mixed step's
        time in decode steps, rounded, within [1, MAX_HOLD_STEPS]; 1 until both are measured."""
        mixed, decode = self.step_cost["mixed"], self.step_cost["decode"]
        if not mixed or not decode:
            return 1
        return max(1, min(MAX_HOLD_STEPS, round(mixed / decode)))

    def key(self, peer: Peer, rid: int) -> int:
        """The core's key of `peer`'s request `rid` (its rid when there is one peer)."""
        return rid * len(self.peers) + peer.index

    @property
    def outbox(self) -> bool:
        """Whether some peer's last message is still being written."""
        return any(p.outbox for p in self.peers if p.open)

    def run(self) -> None:
        try:
            while not self.exiting:
                self.turn()
        except PeerGone:
            pass  # the HTTP process is gone: nobody left to serve
        finally:
            self._abort_all("abort")
            self.times.write()

    def turn(self) -> None:
        """One pass of the loop: commands, the held requests' admission, one step, the
        outputs and state sent (each part's time into `times`)."""
        tm = self.times
        tm.counts["turns"] += 1
        t = time.perf_counter()
        wait = not (self.engine.has_work or self.held)
        self._receive(wait=wait)
        t = tm.add("idle_wait" if wait else "receive", t)
        for peer in self.peers:
            if peer.deadline is not None and time.monotonic() >= peer.deadline:
                self._abort_all("abort", peer)
        if self.held:
            self._admit_held()
            t = tm.add("admit", t)
        if self.engine.has_work:
            e = self.engine
            kind = "mixed" if e.waiting or any(r.prefilling for r in e.running) else "decode"
            self._step()
            tm.counts["steps_" + kind] += 1
            t0, t = t, tm.add("step_" + kind, t)
            last = self.step_cost[kind]
            self.step_cost[kind] = t - t0 if last is None else (
                last + STEP_COST_EMA * (t - t0 - last))
        self._collect()
        t = tm.add("collect", t)
        self._fold()
        t = tm.add("fold", t)
        self._send()
        tm.add("send", t)

    # --- commands ----------------------------------------------------------------------------
    def _receive(self, wait: bool) -> None:
        if wait:
            for peer in self.peers:
                if not peer.open:
                    continue
                events = selectors.EVENT_READ | (selectors.EVENT_WRITE if peer.outbox else 0)
                if events != peer.events:
                    self.selector.modify(peer.sock, events, peer)
                    peer.events = events
            self.selector.select(IDLE_WAIT_S)
        for peer in self.peers:
            if not peer.open:
                continue
            try:
                messages = peer.reader.read()
            except PeerGone:
                self._close(peer)
                continue
            for message in messages:
                self._apply(peer, message)

    def _apply(self, peer: Peer, message: tuple) -> None:
        kind = message[0]
        if kind == "add":
            now = time.perf_counter()
            for rid, prompt, fields, seed_stream in message[1]:
                key = self.key(peer, rid)
                self.held[key] = (prompt, fields, seed_stream, self.steps)
                self.times.arrived[key] = now
        elif kind == "abort":
            for rid in message[1]:
                self._abort(self.key(peer, rid), "abort")
        elif kind == "shutdown":
            peer.deadline = time.monotonic() + float(message[1])
        elif kind == "exit":
            self._close(peer)
        self.dirty = True

    def _abort(self, key: int, reason: str) -> None:
        """End request `key` (live or held) with `reason`; nothing if it already ended."""
        entry = self.live.pop(key, None)
        if entry is not None and not entry[0].finished:
            self.engine.abort(entry[0])
        if entry is not None or self.held.pop(key, None) is not None:
            self._output(key, [], reason)

    def _close(self, peer: Peer) -> None:
        """`peer` said exit or is gone: its requests end; the owner's (peer 0): the loop ends
        (PeerGone when it is gone, `exiting` when it said exit)."""
        if peer.index == 0:
            self.exiting = True
            return
        peer.open = False
        self._abort_all("abort", peer)
        self.outputs = {k: v for k, v in self.outputs.items()
                        if k % len(self.peers) != peer.index}
        self.selector.unregister(peer.sock)
        peer.sock.close()

    def _admit_held(self) -> None:
        """The held requests to the Engine together, when `admit_now` says so."""
        e = self.engine
        waited = self.steps - next(iter(self.held.values()))[3]
        if not admit_now(len(self.held), waited, len(e.running), bool(e.waiting),
                         self.admission_group, self.hold_steps) \
                and not any(r.prefilling for r in e.running):
            return  # (a prefilling request: mixed anyway; looked for only when it decides)
        held, self.held = self.held, {}
        for key, (prompt, fields, seed_stream, _) in held.items():
            self._add(key, prompt, fields, seed_stream)

    def _add(self, key: int, prompt: list[int], fields: dict[str, Any],
             seed_stream: int | None) -> None:
        try:
            params = SamplingParams(**fields)
            req = self.engine.add_request(
                prompt, params, seed_stream=seed_stream if params.seed is not None else None)
        except Exception as e:  # noqa: BLE001 (the HTTP side checked it: not expected)
            self._log(logging.ERROR, f"request rejected by the engine: {type(e).__name__}: {e}")
            self._output(key, [], "error")
            return
        self.live[key] = [req, 0, req.prompt_ranks is None]  # no prompt scores asked: sent
        tr = self.times.requests
        tr["arrival_to_engine_s"] += time.perf_counter() - self.times.arrived.get(
            key, time.perf_counter())
        tr["handed_over"] += 1

    # --- stepping ----------------------------------------------------------------------------
    def _step(self) -> None:
        try:
            self.engine.step()
        except ValueError as e:  # requests the engine flagged end with "error"; others go on
            self.step_errors += 1
            self._log(logging.WARNING, f"engine step: {e}")
        except Exception:  # noqa: BLE001 (the server never dies from one step)
            self.step_errors += 1
            self._log(logging.ERROR, "engine step failed; aborting every live request\n"
                      + traceback.format_exc())
            self._abort_all("error")
        self.steps += 1
        self.dirty = True

    def _collect(self) -> None:
        """Every live request's new ids (and its finish reason once it ended) into `outputs`
        (`_output`): one length check per request that did not change."""
        done = []
        for key, entry in self.live.items():
            r, sent = entry[0], entry[1]
            out, fin = r.output, r.finish_reason
            n = len(out)
            prompt = None
            if not entry[2] and r.prompt_ranks is not None and len(r.prompt_ranks) == len(r.prompt):
                prompt, entry[2] = list(zip(r.prompt_logprobs, r.prompt_ranks,
                                            r.prompt_top_logprobs, strict=True)), True
            if n == sent and fin is None and prompt is None:
                continue
            if sent == 0 and n:
                self._first_ids(key)
            lps = None if r.logprobs is None else list(
                zip(r.logprobs[sent:n], r.top_logprobs[sent:n], strict=True))
            entry[1] = n
            self._output(key, out[sent:n], fin, lps, prompt)
            if fin is not None:
                done.append(key)
        for key in done:
            del self.live[key]

    def _first_ids(self, key: int) -> None:
        arrived = self.times.arrived.pop(key, None)
        if arrived is not None:
            self.times.requests["arrival_to_first_ids_s"] += time.perf_counter() - arrived
            self.times.requests["first_ids"] += 1

    def _output(self, key: int, ids: list[int], finish: str | None,
                lps: list | None = None, prompt: list | None = None) -> None:
        """Queue new ids (and their (logprob, top) pairs when asked; the prompt's scores once)
        for the next message to request `key`'s peer."""
        pending = self.outputs.get(key)
        if pending is None:
            self.outputs[key] = [ids, finish, lps, prompt]
        else:
            pending[0] += ids
            pending[1] = finish or pending[1]
            if lps is not None:
                pending[2] = (pending[2] or []) + lps
            pending[3] = prompt or pending[3]
        if finish is not None:
            self.finished += 1
            self.peers[key % len(self.peers)].finished += 1
            self.times.arrived.pop(key, None)  # (ended before its first ids)

    def _abort_all(self, reason: str, peer: Peer | None = None) -> None:
        """End every request (of `peer` only, when given) with `reason`."""
        n = len(self.peers)
        for key in [k for k in (*self.held, *self.live) if peer is None or k % n == peer.index]:
            self._abort(key, reason)
        self.dirty = True

    # --- messages to the HTTP process --------------------------------------------------------
    def _send(self) -> None:
        """To each peer, one "out" message with its requests' outputs collected since its
        last one and the engine state when one is due (or owed to it), unless its last message
        is still being written (then its outputs keep merging and the state waits)."""
        ready = []
        for peer in self.peers:
            try:
                if peer.open and (not peer.outbox or peer.outbox.flush()):
                    ready.append(peer)
                elif peer.open:
                    self.times.counts["sends_deferred"] += 1
            except PeerGone:
                self._close(peer)
        now = time.monotonic()
        if self.dirty and (not self.engine.has_work or now - self.last_state >= STATE_INTERVAL_S):
            self.last_state, self.dirty = now, False
            for peer in self.peers:
                peer.owes_state = peer.open
        if not self.outputs and not any(p.owes_state for p in ready):
            return
        n = len(self.peers)
        if n == 1:
            batches = {0: [(k, *out) for k, out in self.outputs.items()]} if ready else {}
            self.outputs = {} if ready else self.outputs
        else:
            batches, wanted = {p.index: [] for p in ready}, {p.index for p in ready}
            for key in [k for k in self.outputs if k % n in wanted]:
                batches[key % n].append((key // n, *self.outputs.pop(key)))
        state = None
        for peer in ready:
            mine, owed = batches[peer.index], peer.owes_state
            if not mine and not owed:
                continue
            if owed:
                state = state or self.state()
                peer.owes_state = False
            peer.outbox.put(("out", mine, dict(state, finished=peer.finished) if owed else None))
            try:
                peer.outbox.flush()
            except PeerGone:
                self._close(peer)

    def _log(self, level: int, text: str) -> None:
        """A record for the owner's log (peer 0)."""
        self.peers[0].outbox.put(("log", level, text))

    def state(self) -> dict[str, Any]:
        """The engine state for /metrics and /health (`metrics.EngineState` fields;
        `finished`: every peer's, replaced per peer when sent)."""
        e = self.engine
        pages = e.pages
        return {"waiting": len(e.waiting) + len(self.held), "running": len(e.running),
                "kv_pages_used": pages.num_pages - 1 - pages.num_free_pages,
                "kv_pages_total": pages.num_pages - 1, "steps": self.steps,
                "step_errors": self.step_errors, "accept_hist": dict(self.accept_hist),
                "max_accept": e.cfg.speculative_num_steps + 1, "graphs": dict(self.graphs),
                "finished": self.finished, "has_work": bool(e.has_work or self.held)}

    def _fold(self) -> None:
        """Every FOLD_INTERVAL_S, and when the Engine turned idle after steps: the Engine's
        accept lengths into the state's histogram, its graph use read, its recorder reset."""
        now = time.monotonic()
        turned_idle = self.steps > self.steps_folded and not self.engine.has_work
        if now - self.last_fold < FOLD_INTERVAL_S and not turned_idle:
            return
        self.last_fold, self.steps_folded = now, self.steps
        self.times.write()
        snap = self.engine.metrics_snapshot()
        rows = snap["accept_length"]["histogram"]
        for length, n in rows.items():
            self.accept_hist[int(length)] = self.accept_hist.get(int(length), 0) + n
        self.engine.metrics.reset()
        graphs = {name: (g["replays"], sum(g["eager"].values()))
                  for name, g in snap.get("graphs", {}).items()}
        if rows or graphs != self.graphs:
            self.graphs, self.dirty = graphs, True
