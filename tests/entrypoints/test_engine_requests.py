"""The offline Engine over a tiny model: a stream its consumer stops reading (closed, or an
async iterator's aclose) aborts its request at once rather than generating to the end, and so
does Ctrl-C in a blocking generate; stream items are snapshots; a shut-down engine refuses at
once; the default max_new_tokens never refuses a prompt that fits the context (the scheduler
caps it to the room left, as SGLang's); an explicit one that overflows it is a clear error."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from rs_testing import make_tiny_served_model, save_byte_tokenizer

from radixserve.managers.tokenizer_manager import RequestError

CONTEXT = 8192
LONG = {"max_new_tokens": 8000, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from radixserve import Engine

    model = make_tiny_served_model(str(tmp_path_factory.mktemp("tiny") / "m"), context=CONTEXT)
    with Engine(model_path=model, dtype="float32", max_total_tokens=CONTEXT + 512) as e:
        yield e


def _drained(engine, before: dict) -> dict:
    for _ in range(600):  # (bounded: 60 s)
        info = engine.get_server_info()
        if info["running"] == 0 and info["queued"] == 0:
            break
        time.sleep(0.1)
    assert info["running"] == 0 and info["queued"] == 0
    assert info["available_tokens"] + info["evictable_tokens"] == info["max_total_num_tokens"]
    assert info["num_aborted"] == before["num_aborted"] + 1
    # aborted long before its 8,000 tokens
    assert info["generation_tokens"] - before["generation_tokens"] < LONG["max_new_tokens"] // 2
    return info


def test_closing_a_stream_aborts_its_request(engine):
    before = engine.get_server_info()
    it = engine.generate("hello", LONG, stream=True)
    assert next(it)["meta_info"]["finish_reason"] is None
    it.close()
    _drained(engine, before)


def test_closing_an_async_stream_aborts_its_request(engine):
    async def read_one() -> None:
        it = await engine.async_generate("hello", LONG, stream=True)
        assert (await it.__anext__())["meta_info"]["finish_reason"] is None
        await it.aclose()

    before = engine.get_server_info()
    asyncio.run(read_one())
    _drained(engine, before)


def test_async_streams_take_no_thread_of_the_callers_executor(engine):
    """Each waiting async stream held one of the caller's default-executor threads: more open
    streams than threads stalled one another and the caller's own to_thread calls."""
    import concurrent.futures

    class NoThreads(concurrent.futures.ThreadPoolExecutor):
        def submit(self, *args, **kwargs):
            raise AssertionError("a stream used the caller's executor")

    async def read_streams() -> list[str]:
        asyncio.get_running_loop().set_default_executor(NoThreads(1))
        params = {"max_new_tokens": 5, "ignore_eos": True, "temperature": 0}

        async def one(i: int) -> str:
            text = ""
            async for out in await engine.async_generate(f"hi {i}", params, stream=True):
                text = out["text"]
            return text

        return await asyncio.gather(*(one(i) for i in range(8)))

    texts = asyncio.run(read_streams())
    want = [
        engine.generate(f"hi {i}", {"max_new_tokens": 5, "ignore_eos": True, "temperature": 0})[
            "text"
        ]
        for i in range(8)
    ]
    assert texts == want


def test_abort_request_by_rid_and_all(engine):
    """SGLang's Engine.abort_request(rid, abort_all): there was no way to stop a request of
    the offline engine (its tokenizer manager is not safe to call from another thread)."""
    import concurrent.futures

    before = engine.get_server_info()
    assert engine.abort_request("nobody") is False

    def running(n: int) -> None:
        for _ in range(600):  # (bounded: 60 s)
            if engine.get_server_info()["running"] >= n:
                return
            time.sleep(0.1)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        one = pool.submit(engine.generate, "hello", LONG, rid="mine")
        running(1)
        assert engine.abort_request("mine") is True
        assert one.result(60)["meta_info"]["finish_reason"]["type"] == "abort"
        many = pool.submit(engine.generate, ["a", "b"], LONG)
        running(1)
        assert engine.abort_request(abort_all=True) is True
        outs = many.result(60)
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["abort", "abort"]
    info = engine.get_server_info()
    assert info["num_aborted"] == before["num_aborted"] + 3
    assert info["available_tokens"] + info["evictable_tokens"] == info["max_total_num_tokens"]


def test_the_default_max_new_tokens_never_refuses_a_prompt_that_fits(engine):
    prompt = [5] * (CONTEXT - 40)  # room for 40 tokens, fewer than the default 128
    out = engine.generate(input_ids=prompt, sampling_params={"temperature": 0, "ignore_eos": True})
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert 0 < out["meta_info"]["completion_tokens"] <= 40
    with pytest.raises(RequestError, match="exceeds the model's context length"):
        engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 128})


def test_ctrl_c_in_a_blocking_generate_aborts_its_request(engine):
    """KeyboardInterrupt while generate() waits cancels the request (it ran to its end)."""
    import signal

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    before = engine.get_server_info()
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(KeyboardInterrupt):
            engine.generate("hello", LONG)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    _drained(engine, before)


def test_stream_items_are_snapshots_the_caller_may_keep(engine):
    """Each item holds the tokens (and logprobs) as of its own output, not a list the engine's
    thread goes on extending. (A reader slower than the engine gets only the latest output:
    on a loaded machine the stream may be one item.)"""
    params = {"max_new_tokens": 48, "ignore_eos": True, "temperature": 0}

    def check(items: list) -> None:
        assert items and items[-1]["meta_info"]["completion_tokens"] == 48
        for item in items:
            n = item["meta_info"]["completion_tokens"]
            assert len(item["output_ids"]) == n
            assert len(item["meta_info"]["output_token_logprobs"]) == n
        assert items[-1]["output_ids"][: len(items[0]["output_ids"])] == items[0]["output_ids"]

    check(list(engine.generate("hello", params, stream=True, return_logprob=True)))

    async def collect() -> list:
        it = await engine.async_generate("hello", params, stream=True, return_logprob=True)
        return [item async for item in it]

    check(asyncio.run(collect()))


def _pumps(engine, monkeypatch) -> list:
    """The futures of the streams' pumps (Engine._start_stream), to wait for a stream's end."""
    pumps, start = [], engine._start_stream

    def started(*args):
        pumps.append(start(*args))
        return pumps[-1]

    monkeypatch.setattr(engine, "_start_stream", started)
    return pumps


def test_a_stream_read_slowly_keeps_only_its_latest_output(engine, monkeypatch):
    """Every output was queued as a copy of all so far for a reader busy elsewhere: O(output²)
    memory (250 MB for 8,000 tokens). Read after the request's end, a stream gives its final
    output once, one per index for a batch, the tokens that a non-streamed request gives."""
    params = {"max_new_tokens": 48, "ignore_eos": True, "temperature": 0}
    alone, want = engine.generate("hello", params), engine.generate(["hello", "world"], params)
    pumps = _pumps(engine, monkeypatch)

    it = engine.generate("hello", params, stream=True, return_logprob=True)
    assert next(it)["meta_info"]["finish_reason"] is None
    pumps[-1].result(60)
    (last,) = list(it)
    assert last["output_ids"] == alone["output_ids"] and last["text"] == alone["text"]
    assert len(last["meta_info"]["output_token_logprobs"]) == 48

    it = engine.generate(["hello", "world"], params, stream=True)
    first = next(it)
    pumps[-1].result(60)
    rest = list(it)
    assert sorted(out["index"] for out in rest) == [0, 1]  # (the first's index went on)
    assert all(out["meta_info"]["finish_reason"] is not None for out in rest)
    assert first["output_ids"] == want[first["index"]]["output_ids"][: len(first["output_ids"])]
    for out in rest:
        assert out["output_ids"] == want[out["index"]]["output_ids"]

    async def read_after_the_end() -> list:
        it = await engine.async_generate("hello", params, stream=True)
        await it.__anext__()
        await asyncio.wrap_future(pumps[-1])  # (after the outputs it put on this loop)
        return [out async for out in it]

    (last,) = asyncio.run(read_after_the_end())
    assert last["output_ids"] == alone["output_ids"]


def test_an_engine_shut_down_refuses_at_once_and_leaves_no_files(tmp_path):
    from radixserve import Engine

    model = make_tiny_served_model(str(tmp_path / "m"))
    e = Engine(model_path=model, dtype="float32", max_total_tokens=1024)
    assert e.generate("hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2
    ipc_dir = e.procs.port_args.ipc_dir
    assert os.path.isdir(ipc_dir)
    e.shutdown()
    assert not os.path.exists(ipc_dir)  # its socket files went with it (one dir per start)
    for call in (
        lambda: e.generate("hi"),
        lambda: next(iter(e.generate("hi", stream=True))),
        e.get_server_info,
        e.flush_cache,
        lambda: asyncio.run(e.async_generate("hi")),
    ):
        with pytest.raises(RuntimeError, match="the engine is shut down"):
            call()


def test_shutdown_wakes_the_readers_of_its_requests(tmp_path):
    """A thread reading a stream blocked forever when shutdown() ran; a blocking generate got
    a bare CancelledError."""
    import threading

    from radixserve import Engine

    model = make_tiny_served_model(str(tmp_path / "m"), context=CONTEXT)
    e = Engine(model_path=model, dtype="float32", max_total_tokens=CONTEXT + 512)
    errors: dict[str, BaseException] = {}

    def read_stream() -> None:
        try:
            for _ in e.generate("hi", LONG, stream=True):
                pass
        except BaseException as err:  # noqa: BLE001 (what the reader sees)
            errors["stream"] = err

    def blocking() -> None:
        try:
            e.generate("ho", LONG)
        except BaseException as err:  # noqa: BLE001
            errors["generate"] = err

    threads = [threading.Thread(target=f, daemon=True) for f in (read_stream, blocking)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while e.get_server_info()["running"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    e.shutdown()
    for t in threads:
        t.join(15)
        assert not t.is_alive(), "a reader still blocked after shutdown()"
    for name in ("stream", "generate"):
        assert isinstance(errors[name], RuntimeError), errors
        assert "shut down" in str(errors[name])


def test_an_engine_dropped_without_shutdown_is_collected_and_stops_its_processes(tmp_path):
    """Its watch thread held it: never collected, __del__ never ran, and each dropped engine
    left a scheduler, a detokenizer and their socket directory behind."""
    import gc
    import weakref

    import psutil

    from radixserve import Engine

    model = make_tiny_served_model(str(tmp_path / "m"))
    before = {p.pid for p in psutil.Process().children()}  # (multiprocessing's tracker)
    e = Engine(model_path=model, dtype="float32", max_total_tokens=1024)
    assert e.generate("hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2
    children = [p for p in psutil.Process().children() if p.pid not in before]
    assert len(children) >= 2
    ipc_dir, ref = e.procs.port_args.ipc_dir, weakref.ref(e)
    del e
    gc.collect()
    assert ref() is None
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive and not os.path.exists(ipc_dir)


def test_an_engine_that_fails_to_start_leaves_no_thread_behind(tmp_path):
    """Its shutdown, run by __del__, raised on the tokenizer manager it never made, and the
    loop's thread (with three file descriptors) stayed for good, one more per failed start."""
    import threading

    from radixserve import Engine

    model = make_tiny_served_model(str(tmp_path / "m"))
    before = set(threading.enumerate())
    with pytest.raises(RuntimeError, match="scheduler failed to start"):  # (no such memory)
        Engine(model_path=model, dtype="float32", max_total_tokens=10**13)
    left = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    assert left == []


def test_a_pool_larger_than_memory_is_refused_at_start(tmp_path):
    """--max-running-requests (or --max-total-tokens) past the free memory: the request table
    was allocated lazily and the scheduler was OOM-killed a minute later ("exited during
    start-up (code -9)"), taking memory from everything else on the machine."""
    from radixserve import Engine

    model = make_tiny_served_model(str(tmp_path / "m"))
    with pytest.raises(RuntimeError, match=r"--max-running-requests 100000000 need .* GiB"):
        Engine(model_path=model, max_total_tokens=10**8, max_running_requests=10**8)


def test_another_models_larger_tokenizer_is_refused_at_start_in_one_line(tmp_path, capfd):
    """--tokenizer-path of a model with a larger vocabulary: the server came up "ready" and
    refused every request with a 400 blaming the client's input_ids. A refusal of the flags
    is its message, without the scheduler's traceback."""
    from radixserve import Engine

    model = make_tiny_served_model(str(tmp_path / "m"))  # (its vocabulary: 320 tokens)
    save_byte_tokenizer(str(tmp_path / "tok"), 1000)
    with pytest.raises(RuntimeError, match=r"the tokenizer's vocabulary \(1000 tokens\) is larger"):
        Engine(model_path=model, tokenizer_path=str(tmp_path / "tok"))
    assert "Traceback" not in capfd.readouterr().err


def test_ctrl_c_while_an_engine_starts_stops_it_at_once(tmp_path):
    """KeyboardInterrupt in Engine(...) (the model loading for minutes): the loop's thread sat
    in the start-up until the children were ready, so the interrupt became a bare TimeoutError
    from shutdown() 10 s later and the children went on loading. A TP rank that waits for a
    node that never comes stands in for a long load."""
    import multiprocessing
    import signal
    import threading

    from radixserve import Engine
    from radixserve.utils import free_port

    model = make_tiny_served_model(str(tmp_path / "m"))

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    before = set(threading.enumerate())
    children = set(multiprocessing.active_children())  # (the module's engine's)
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 3.0)
        with pytest.raises(KeyboardInterrupt):
            Engine(
                model_path=model,
                dtype="float32",
                tp_size=2,
                nnodes=2,
                dist_init_addr=f"127.0.0.1:{free_port()}",
            )
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert set(multiprocessing.active_children()) == children
    left = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    assert left == []


def test_shutdown_closes_the_loop_and_an_engine_dropped_mid_stream_is_stopped(tmp_path):
    """shutdown() left the loop open (its thread pool and file descriptors stayed while the
    Engine was referenced). An engine whose last reference was a stream's, dropped, was
    collected on its own loop's thread: shutdown() waited 5 s there for itself and the loop
    never stopped."""
    import gc
    import weakref

    from radixserve import Engine

    model = make_tiny_served_model(str(tmp_path / "m"), context=CONTEXT)
    e = Engine(model_path=model, dtype="float32", max_total_tokens=CONTEXT + 512)
    loop = e.loop
    e.shutdown()
    assert loop.is_closed()
    e = Engine(model_path=model, dtype="float32", max_total_tokens=CONTEXT + 512)
    stream = e.generate("hi", LONG, stream=True)
    next(stream)
    thread, ref = e._thread, weakref.ref(e)
    del e
    stream.close()
    del stream
    gc.collect()
    thread.join(10)
    assert not thread.is_alive() and ref() is None


def test_an_engine_made_in_a_thread_that_ends_keeps_its_processes(tmp_path):
    """The children die with the thread that started them (PR_SET_PDEATHSIG): an Engine made
    in a worker thread answered every request with a 503 once that thread ended."""
    from concurrent.futures import ThreadPoolExecutor

    from radixserve import Engine

    model = make_tiny_served_model(str(tmp_path / "m"))
    with ThreadPoolExecutor(1) as pool:
        e = pool.submit(Engine, model_path=model, dtype="float32", max_total_tokens=1024).result()
    try:
        time.sleep(1.5)  # the engine's child watch polls every 0.5 s
        assert e.generate("hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2
    finally:
        e.shutdown()


def test_a_process_that_exits_without_shutdown_leaves_no_files(tmp_path):
    import subprocess
    import sys

    model = make_tiny_served_model(str(tmp_path / "m"))
    script = (
        "from radixserve import Engine\n"
        f"e = Engine(model_path={model!r}, dtype='float32', max_total_tokens=1024)\n"
        "print(e.procs.port_args.ipc_dir, flush=True)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    ipc_dir = out.stdout.strip().splitlines()[-1]
    assert ipc_dir and not os.path.exists(ipc_dir)


def test_the_socket_directory_of_a_killed_engine_goes_at_the_next_start(tmp_path, monkeypatch):
    """SIGKILL skips every clean-up: the next start in the same temporary directory removes
    the socket directories whose owner is gone, and only those."""
    import signal
    import subprocess
    import sys
    import tempfile

    from radixserve.utils import IPC_OWNER_FILE, PortArgs

    model = make_tiny_served_model(str(tmp_path / "m"))
    tmp = tmp_path / "t"
    tmp.mkdir()
    script = (
        "import time\n"
        "from radixserve import Engine\n"
        f"e = Engine(model_path={model!r}, dtype='float32', max_total_tokens=1024)\n"
        "print(e.procs.port_args.ipc_dir, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp)},
    )
    try:
        killed = proc.stdout.readline().strip()
        assert killed.startswith(str(tmp)) and os.path.isdir(killed)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert os.path.isdir(killed)
    live = tmp / "radixserve-live"  # a running server's: its owner is this process
    live.mkdir()
    (live / IPC_OWNER_FILE).write_text(f"{os.getpid()} {os.readlink('/proc/self/ns/pid')}")
    foreign = tmp / "radixserve-foreign"  # another pid namespace's (a container's): unknown
    foreign.mkdir()
    (foreign / IPC_OWNER_FILE).write_text(f"{proc.pid} pid:[1]")
    older = tmp / "radixserve-older"  # no owner file: left alone
    older.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    new = PortArgs.new()
    try:
        assert not os.path.exists(killed)
        assert live.is_dir() and foreign.is_dir() and older.is_dir()
        assert os.path.dirname(new.ipc_dir) == str(tmp)
    finally:
        import shutil

        shutil.rmtree(new.ipc_dir)


def test_server_info_is_sglangs_shape(engine):
    """Engine.get_server_info gave the scheduler's figures alone: SGLang's scripts read
    internal_states[0]["avg_spec_accept_length"], the arguments, the version from it."""
    info = engine.get_server_info()
    assert info["internal_states"][0]["dp_rank"] == 0 and info["version"]
    assert info["tp_size"] == info["dp_size"] == 1 and info["dtype"] == "float32"
    assert info["model_path"] and info["api_key"] is None
    assert info["running"] == 0 and "available_tokens" in info
    assert info["max_running_requests"] == info["max_running_requests_total"] > 0


def test_logprob_fields_per_prompt_and_sglangs_named_parameters(engine):
    """A list of one value per prompt for return_logprob / logprob_start_len /
    top_logprobs_num (SGLang's), and SGLang's generate parameters at the values that ask for
    nothing (image_data=None, ...): each was refused."""
    out = engine.generate(
        input_ids=[[5, 6, 7], [8, 9, 10, 11]],
        sampling_params={"max_new_tokens": 2, "temperature": 0},
        return_logprob=[True, False],
        logprob_start_len=[0, -1],
        top_logprobs_num=[2, 0],
        image_data=None,
        token_ids_logprob=None,
        custom_logit_processor=None,
        return_hidden_states=False,
    )
    first, second = (o["meta_info"] for o in out)
    assert len(first["input_token_logprobs"]) == 3 and len(first["output_token_logprobs"]) == 2
    assert all(len(top) == 2 for top in first["output_top_logprobs"])
    assert "output_token_logprobs" not in second or not second["output_token_logprobs"]
    alone = engine.generate(
        input_ids=[5, 6, 7],
        sampling_params={"max_new_tokens": 2, "temperature": 0},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=2,
    )["meta_info"]
    # (the same tokens; the values within float32 rounding: a batch of two and one prompt
    # alone take different matmul kernels on some CPUs, AMD Zen 5's among them)
    batched, single = first["output_token_logprobs"], alone["output_token_logprobs"]
    assert [t[1:] for t in batched] == [t[1:] for t in single]
    assert [t[0] for t in batched] == pytest.approx([t[0] for t in single], abs=1e-5)
    with pytest.raises(RequestError, match="return_logprob must be a boolean, or a list of one"):
        engine.generate(input_ids=[[5], [6]], return_logprob=[True])
    with pytest.raises(RequestError, match="image_data is not supported"):
        engine.generate(prompt="hi", image_data="cat.png")


def test_sglangs_none_defaults_and_empty_values_ask_for_nothing(engine):
    """SGLang's Engine.generate passes logprob_start_len=None and top_logprobs_num=None (its
    defaults), [] for token_ids_logprob, a None per prompt of a batch for image_data, and may
    give one prompt a one-item lora_path list: a wrapper with its signature was refused."""
    params = {"max_new_tokens": 2, "temperature": 0}
    want = engine.generate(input_ids=[5, 6, 7], sampling_params=params)["output_ids"]
    out = engine.generate(
        input_ids=[5, 6, 7],
        sampling_params=params,
        return_logprob=None,
        logprob_start_len=None,
        top_logprobs_num=None,
        return_text_in_logprobs=None,
        token_ids_logprob=[],
        lora_path=[None],
        stream=None,
    )
    assert out["output_ids"] == want and "output_token_logprobs" not in out["meta_info"]
    outs = engine.generate(
        input_ids=[[5, 6, 7], [5, 6, 7]],
        sampling_params=params,
        image_data=[None, None],
        return_logprob=True,
        logprob_start_len=None,
    )
    assert [o["output_ids"] for o in outs] == [want, want]
    assert all(len(o["meta_info"]["output_token_logprobs"]) == 2 for o in outs)
    with pytest.raises(RequestError, match="image_data is not supported"):
        engine.generate(input_ids=[[5], [6]], image_data=[None, "cat.png"])


def test_control_calls_answer_as_sglangs_engine_does(engine):
    """SGLang's scripts read flush_cache().success and load_lora_adapter(...).success: a bool
    and a dict had no such attribute."""
    flushed = engine.flush_cache()
    assert flushed and flushed.success and flushed == {"success": True, "message": ""}
    refused = engine.load_lora_adapter("a", "/nonexistent")  # (an engine without LoRA)
    assert not refused and not refused.success and "serves no LoRA adapters" in refused.message
    assert not refused["success"]


def test_sglangs_sampling_param_names(engine):
    """The offline Engine refused SGLang's sampling_seed, and the empty stop_regex and
    custom_params its scripts send, that /generate accepts: an SGLang script failed here."""
    params = {"max_new_tokens": 4, "temperature": 1.0}
    want = engine.generate(input_ids=[5, 6, 7], sampling_params={**params, "seed": 3})
    got = engine.generate(
        input_ids=[5, 6, 7],
        sampling_params={**params, "sampling_seed": 3, "stop_regex": [], "custom_params": None},
    )
    assert got["output_ids"] == want["output_ids"]
    with pytest.raises(RequestError, match="stop_regex is not supported"):
        engine.generate(input_ids=[5], sampling_params={"stop_regex": ["a+"]})


def test_a_detokenizer_dead_during_the_model_load_fails_the_start_at_once():
    """The start-up waited for the scheduler's "ready" (the model loaded: minutes for a large
    one) before it looked at the detokenizer, killed 8 s in."""
    from types import SimpleNamespace

    from radixserve.entrypoints.engine import Subprocesses

    procs = object.__new__(Subprocesses)
    procs._stop = None
    procs.detokenizer = SimpleNamespace(exitcode=-9)
    loading = SimpleNamespace(is_alive=lambda: True, exitcode=None)
    silent = SimpleNamespace(poll=lambda timeout: time.sleep(timeout) or False)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"the detokenizer exited during start-up \(code -9\)"):
        procs._wait_ready(silent, loading, "scheduler")
    assert time.monotonic() - start < 5
