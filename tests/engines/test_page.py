"""A page's cost is bounded: chunked reading keeps what a whole page gives, and refuses past its limits."""

from __future__ import annotations

import asyncio
import time

import pytest

from gpuscaler.gateway.engines import page as page_module
from gpuscaler.gateway.engines import page_reader as page_reader_module
from gpuscaler.gateway.engines.page import MalformedPage, TooManyLabelSets, prefilter, read_whole_page
from gpuscaler.gateway.engines.page_reader import ScrapeFailed
from gpuscaler.gateway.engines.page_reader import read_page as read_in_turns
from gpuscaler.model.engines import Engine, engine_series, series_bounds
from tests.fakes.fake_engine import FakeEngine

WANTED = prefilter(engine_series(Engine.VLLM), series_bounds(Engine.VLLM))


def chunked(body: bytes, size: int) -> list[bytes]:
    """``body`` cut every ``size`` bytes, as a socket may deliver it."""
    return [body[start : start + size] for start in range(0, len(body), size)]


def label_sets(count: int, value: float = 1.0, name: str = "vllm:num_requests_waiting") -> bytes:
    """A page of ``count`` label sets of ``name``, each ``value``."""
    lines = [f"# HELP {name} x", f"# TYPE {name} gauge"]
    lines += [f'{name}{{model_name="m{index}",engine="0"}} {value}' for index in range(count)]
    return ("\n".join(lines) + "\n").encode()


@pytest.mark.parametrize("size", [1, 7, 64, 4096])
def test_a_page_read_in_chunks_gives_what_the_whole_page_gives(size: int) -> None:
    """Cut anywhere, even one byte at a time, a real page gives the same values and label-set counts as read whole."""
    body = FakeEngine(Engine.VLLM, {"waiting": 3, "running": 5, "kv": 0.25}).page().encode()
    whole = read_whole_page(body, WANTED, at=0.0)
    page = WANTED.filter()
    for chunk in chunked(body, size):
        page.feed(chunk)
    values: dict[str, float] = {}
    counts: dict[str, int] = {}
    for text in page_module.batches(page.finish()):
        page_module.add_values(text, values, counts, WANTED)
    assert (values, counts) == (whole.values, whole.counts)
    assert whole.values["vllm:num_requests_waiting"] == 3.0


def test_a_last_line_without_a_newline_counts() -> None:
    """The page's last line is read though no newline ends it."""
    assert read_whole_page(b"vllm:num_requests_waiting 4", WANTED, at=0.0).values == {"vllm:num_requests_waiting": 4.0}


def test_label_sets_past_the_limit_refuse_the_page_naming_the_series() -> None:
    """One label set more than the limit refuses the page, naming the series and the limit; the limit itself passes."""
    assert read_whole_page(label_sets(16), WANTED, at=0.0, max_label_sets=16).values["vllm:num_requests_waiting"] == 16
    with pytest.raises(TooManyLabelSets, match=r"more than 16 label sets of vllm:num_requests_waiting"):
        read_whole_page(label_sets(17), WANTED, at=0.0, max_label_sets=16)


def test_a_series_named_on_many_other_lines_refuses_the_page() -> None:
    """Lines that only name a wanted series (in a label value) count too, so no page makes the filter work per line."""
    other = "".join(f'other{{x="vllm:num_requests_waiting {index}"}} 1\n' for index in range(40))
    with pytest.raises(TooManyLabelSets, match="named on more than 16 lines that are not its samples"):
        read_whole_page(other.encode(), WANTED, at=0.0, max_label_sets=16)


def test_a_refused_page_stops_before_the_rest_of_it_is_read() -> None:
    """A page of 109,230 label sets is refused at the limit, in far less time than the parser would take on it."""
    body = label_sets(109_230)
    started = time.process_time()
    with pytest.raises(TooManyLabelSets):
        read_whole_page(body, WANTED, at=0.0, max_label_sets=64)
    refused = time.process_time() - started
    started = time.process_time()
    read_whole_page(label_sets(2_000), WANTED, at=0.0)
    parsed_2000 = time.process_time() - started
    assert refused < parsed_2000  # 109,230 lines filtered cost less than 2,000 parsed


def test_a_kept_line_over_the_line_limit_is_malformed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wanted series' line longer than MAX_LINE_BYTES is refused, whatever the chunks."""
    monkeypatch.setattr(page_module, "MAX_LINE_BYTES", 100)
    body = b'vllm:num_requests_waiting{x="' + b"a" * 300 + b'"} 1\n'
    page = WANTED.filter()
    chunks = chunked(body, 32)
    for chunk in chunks[:3]:  # the line's first 96 bytes: not over yet
        page.feed(chunk)
    with pytest.raises(MalformedPage, match="over 100 bytes"):
        page.feed(chunks[3])


def test_a_value_past_its_signals_bound_is_malformed() -> None:
    """A queue of 1.7e308 in one label set is past the bound one label set can read, and refused naming it."""
    with pytest.raises(MalformedPage, match=r"vllm:num_requests_waiting is 1.7e\+308, past the 1e\+06"):
        read_whole_page(label_sets(1, 1.7e308), WANTED, at=0.0)
    with pytest.raises(MalformedPage, match=r"vllm:kv_cache_usage_perc is 1\.5, past the 1 "):
        read_whole_page(b"vllm:kv_cache_usage_perc 1.5\n", WANTED, at=0.0)


def test_a_counter_that_sums_to_infinity_is_malformed() -> None:
    """Two label sets of a counter at 1.7e308 add up to infinity: the page is refused, not the sum believed."""
    triton = prefilter(engine_series(Engine.TRITON), series_bounds(Engine.TRITON))
    text = (
        "# TYPE nv_inference_request_success counter\n"
        'nv_inference_request_success{model="a",version="1"} 1.7e308\n'
        'nv_inference_request_success{model="b",version="1"} 1.7e308\n'
    )
    with pytest.raises(MalformedPage, match="nv_inference_request_success sums to inf"):
        read_whole_page(text.encode(), triton, at=0.0)


async def test_the_reader_refuses_past_the_limit_as_too_many_label_sets_and_empties_the_body() -> None:
    """Read in turns, a page past the limit is ScrapeFailed with its own outcome, and its chunks are let go."""
    body = chunked(label_sets(100), 1024)
    with pytest.raises(ScrapeFailed, match="more than 16 label sets") as refused:
        await read_in_turns(body, WANTED, at=0.0, max_label_sets=16)
    assert refused.value.outcome == "too_many_label_sets"
    assert body == []


async def test_reading_in_turns_lets_the_loop_run_between_batches() -> None:
    """While a page of 8,000 label sets is read, the event loop runs other callbacks between its batches."""
    turns = 0

    async def other() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(other())
    await asyncio.sleep(0)
    try:
        page = await read_in_turns(chunked(label_sets(8_000), 65536), WANTED, at=0.0, max_label_sets=8192)
    finally:
        task.cancel()
    assert page.values["vllm:num_requests_waiting"] == 8_000
    parsed = sum(len(line) + 1 for line in label_sets(8_000).splitlines()[2:])
    assert turns >= parsed // (page_module.PARSE_BATCH_BYTES + page_module.MAX_LINE_BYTES)


def test_a_kept_line_over_the_line_limit_inside_one_chunk_is_malformed() -> None:
    """A wanted series' line over MAX_LINE_BYTES is refused though one chunk holds all of it and its newline."""
    long = b'vllm:num_requests_waiting{m="' + b"a" * page_module.MAX_LINE_BYTES + b'"} 1\n'
    with pytest.raises(MalformedPage, match=f"over {page_module.MAX_LINE_BYTES} bytes"):
        read_whole_page(label_sets(3) + long, WANTED, at=0.0)
    fits = b'vllm:num_requests_waiting{m="' + b"a" * (page_module.MAX_LINE_BYTES - 40) + b'"} 1\n'
    assert read_whole_page(label_sets(3) + fits, WANTED, at=0.0).values["vllm:num_requests_waiting"] == 4


def test_a_second_type_line_of_a_name_is_malformed() -> None:
    """A name has one TYPE line; a page that gives it two is refused, so no batch repeats thousands of them."""
    body = label_sets(2) + b"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 1\n"
    with pytest.raises(MalformedPage, match="a second TYPE line of vllm:num_requests_waiting"):
        read_whole_page(body, WANTED, at=0.0)


WAITING = "vllm:num_requests_waiting"
# The pages issue 31's review found costly under every limit (each refused as), and one of long label sets that fits.
COSTLY_PAGES = {
    "256 label sets of 15 kB": (
        "".join(f'{WAITING}{{m="{index:x}{"a" * 15_000}"}} 1\n' for index in range(256)).encode(),
        65536,
        "over 4096 bytes",
    ),
    "8,000 TYPE lines": (
        (f"# TYPE {WAITING} gauge\n" * 8_000 + "".join(f'{WAITING}{{m="{i:x}"}} 1\n' for i in range(8_000))).encode(),
        65536,
        "a second TYPE line",
    ),
    "one line of 3 MB in one chunk": (f'{WAITING}{{m="{"a" * 3_000_000}"}} 1\n'.encode(), 3_000_100, "over 4096 bytes"),
    "400 label sets of 3.9 kB": (
        "".join(f'{WAITING}{{m="{i:x}{"a" * 3_900}"}} 1\n' for i in range(400)).encode(),
        65536,
        None,
    ),
}


@pytest.mark.parametrize("name", list(COSTLY_PAGES))
async def test_no_page_gives_one_turn_more_than_a_batch_of_work(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Read in turns, each turn of a costly page filters at most FEED_BYTES and parses at most PARSE_BATCH_BYTES
    (plus its TYPE line and the sample that crossed it): work counted, not timed."""
    fed: list[int] = []
    parsed: list[int] = []
    feed, add_values = page_module.PageFilter.feed, page_module.add_values

    def counted_feed(self: page_module.PageFilter, chunk: bytes) -> None:
        fed.append(len(chunk))
        feed(self, chunk)

    def counted_add_values(
        text: bytes,
        values: dict[str, float],
        counts: dict[str, int],
        wanted: page_module.Prefilter,
        pools: page_module.Pools | None = None,
    ) -> None:
        parsed.append(len(text))
        add_values(text, values, counts, wanted, pools)

    monkeypatch.setattr(page_module.PageFilter, "feed", counted_feed)
    monkeypatch.setattr(page_reader_module, "add_values", counted_add_values)
    body, size, refused = COSTLY_PAGES[name]
    if refused is None:
        page = await read_in_turns(chunked(body, size), WANTED, at=0.0, max_label_sets=8192)
        assert page.values[WAITING] == 400  # read, in many turns
        assert len(parsed) >= len(body) // (page_module.PARSE_BATCH_BYTES + page_module.MAX_LINE_BYTES)
    else:
        with pytest.raises(MalformedPage, match=refused):
            await read_in_turns(chunked(body, size), WANTED, at=0.0, max_label_sets=8192)
    assert max(fed) <= page_reader_module.FEED_BYTES
    assert max(parsed, default=0) <= page_module.PARSE_BATCH_BYTES + 2 * page_module.MAX_LINE_BYTES
