"""One contract for every registered sink and source (a real mooncake_master, real Zarr folders).

Parametrized over the registries: a new backend only says how its samples read back (READ_BACK),
whether it is live (LIVE) and which sink fills it as a source (PUBLISHED_BY)."""

import json
import time
import typing
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import is_dataclass, replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from services import small_cfg, start_master, stop
import dspark.connector  # noqa: F401  (registers every sink and source)
from dspark.connector.base import Sample, Sink, Source, open_sink
from dspark.connector.config import SinkConfig, ZarrConfig
from dspark.connector.registry import BACKENDS, SINKS, SOURCES
from dspark.connector.live import LiveConfig
from dspark.connector.manifest import StoreManifest
from dspark.connector.mooncake.client import connect
from dspark.connector.mooncake.errors import ProducerFailed
from dspark.connector.mooncake.reader import MooncakeReader
from dspark.connector.mooncake.wire import sample_key
from dspark.connector.zarr.reader import ZarrStore
from dspark.core.errors import InputError

SINK_SPECS = [*sorted(SINKS), "zarr,mooncake"]
IDS = [0, 1, 2, 3]
LIVE = {"zarr": False, "mooncake": True}
PUBLISHED_BY = {"zarr": "zarr", "mooncake": "mooncake"}  # the sink whose output each source reads


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    proc, addr = start_master(tmp_path_factory.mktemp("master"))
    # The only memory mounted: objects never live in (and vanish with) some test's short-lived client.
    holder = connect(replace(small_cfg(64), master=addr))
    yield addr
    del holder
    stop(proc)


@pytest.fixture
def env(tmp_path, master):
    # A fresh store identity per test: Mooncake keys are scoped by it, so tests sharing the master never collide.
    manifest = StoreManifest(verifier_name="t", verifier_config_hash="c", tokenizer_hash="t", target_layer_ids=[1],
                             num_hidden_layers=2, hidden_size=16, dtype="bfloat16", chunk_tokens=16,
                             prepared_fingerprint=uuid.uuid4().hex)
    return SimpleNamespace(store=tmp_path / "store", manifest=manifest, master=master)


def mc_cfg(env):  # mounts no memory, so closing a sink never lingers for consumers
    return replace(small_cfg(32), master=env.master, global_segment_gib=0)


def reader(env) -> MooncakeReader:  # one per test: a Mooncake client takes ~1 s to tear down
    if not hasattr(env, "reader"):
        env.reader = MooncakeReader(env.manifest, mc_cfg(env))
    return env.reader


READ_BACK = {"zarr": lambda env, i: ZarrStore(env.store).read(i),
             "mooncake": lambda env, i: reader(env).get(i, timeout=5)}


def open_spec(spec: str, env) -> Sink:
    return open_sink(spec, manifest=env.manifest, zarr=ZarrConfig(store=env.store), mooncake=mc_cfg(env))


def make_sample(i: int) -> Sample:
    n = 5 + 7 * i  # lengths below, at and across the 16-token chunk
    hidden = torch.randn(n, 2, 16, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
    return Sample(i, np.arange(n, dtype=np.int64) + 100 * i, hidden)


def assert_same(got: Sample, want: Sample) -> None:
    assert got.sample_id == want.sample_id and got.token_ids.dtype == np.int64
    assert np.array_equal(got.token_ids, want.token_ids)
    assert got.hidden_states.dtype == want.hidden_states.dtype and got.hidden_states.shape == want.hidden_states.shape
    assert torch.equal(got.hidden_states.view(torch.int16), want.hidden_states.view(torch.int16))


def assert_reads_back(spec: str, env, sample: Sample) -> None:
    for name in spec.split(","):
        assert_same(READ_BACK[name](env, sample.sample_id), sample)


@pytest.mark.parametrize("spec", SINK_SPECS)
def test_a_flushed_write_is_durable_reads_back_bit_exactly_and_close_is_safe(spec, env):
    sink, sample = open_spec(spec, env), make_sample(3)
    assert isinstance(sink, Sink) and not sink.has(3)
    future = sink.write(sample)
    assert isinstance(future, Future)
    sink.flush()
    assert future.done() and future.exception() is None and sink.has(3)
    assert_reads_back(spec, env, sample)
    sink.close()


@pytest.mark.parametrize("spec", SINK_SPECS)
def test_the_write_future_resolves_to_transfer_params_exactly_when_a_live_sink_takes_part(spec, env):
    sink = open_spec(spec, env)
    future = sink.write(make_sample(2))
    sink.flush()
    params = future.result(timeout=0)
    if any(LIVE[name] for name in spec.split(",")):
        assert params["handle"] == sample_key(env.manifest, 2) and isinstance(params["metadata"]["xxh3_64"], int)
    else:
        assert params is None
    sink.close()


@pytest.mark.parametrize("spec", SINK_SPECS)
def test_write_error_never_raises_fails_a_waiting_reader_fast_and_a_later_write_wins(spec, env):
    sink, live = open_spec(spec, env), any(LIVE[name] for name in spec.split(","))
    with ThreadPoolExecutor(1) as pool:  # an offline sink's write_error is a no-op: nobody waits on it
        waiting = pool.submit(reader(env).get, 5, timeout=10) if live else None
        time.sleep(0.2)  # the reader is polling before the marker appears
        t = time.monotonic()
        sink.write_error(sample_key(env.manifest, 5), "boom")
        if live:
            with pytest.raises(ProducerFailed, match="boom"):
                waiting.result(timeout=5)
            assert time.monotonic() - t < 2
    assert not sink.has(5)
    sample = make_sample(1)  # a regenerated sample is not shadowed by a stale error marker
    sink.write(sample)
    sink.flush()
    assert_reads_back(spec, env, sample)
    sink.close()


@pytest.mark.parametrize("registry", [SINKS, SOURCES], ids=["sinks", "sources"])
def test_registering_a_name_twice_is_an_error_and_keeps_the_first(registry):
    assert registry, "importing dspark.connector registers the backends"
    for name in sorted(registry):
        first = registry[name]
        with pytest.raises(ValueError, match="registered twice"):
            registry.register(name)(lambda **_: None)
        assert registry[name] is first


def test_each_backend_names_its_own_config_which_sink_config_holds_under_its_name():
    hints = typing.get_type_hints(SinkConfig)
    for name, backend in BACKENDS.items():
        assert hints[name] is backend.config_class and name in SINKS and name in SOURCES
    assert {n for n, h in hints.items() if is_dataclass(h)} == set(BACKENDS)


def test_the_vllm_extra_config_round_trips_nested_per_backend_and_refuses_an_unknown_key_in_one_line(tmp_path):
    cfg = SinkConfig(to="zarr,mooncake", zarr=ZarrConfig(store=str(tmp_path), rewrite=[3], segment_attrs={"a": "b"}),
                     prepared_fingerprint="p", encoding="fp8_e4m3")
    extra = json.loads(json.dumps(cfg.to_extra_config()))  # what reaches vLLM's workers
    assert SinkConfig.from_extra_config(extra) == cfg and extra["zarr"]["store"] == str(tmp_path)
    with pytest.raises(InputError, match=r"^unknown setting 'bogus' in kv_connector_extra_config\.zarr"):
        SinkConfig.from_extra_config({**extra, "zarr": {**extra["zarr"], "bogus": 1}})
    with pytest.raises(InputError, match=r"^unknown setting 'store' in kv_connector_extra_config"):
        SinkConfig.from_extra_config({**extra, "store": str(tmp_path)})  # the flat shape of before


class Prompts(list):  # the PromptSet a live source needs: the prepared data's fingerprint and token ids
    def __init__(self, fingerprint: str, samples: list[Sample]):
        super().__init__(s.token_ids.copy() for s in samples)
        self.fingerprint = fingerprint

    token_ids = list.__getitem__


@pytest.fixture(params=sorted(SOURCES))
def source(request, env):
    samples = [make_sample(i) for i in IDS]
    producer = open_spec(PUBLISHED_BY[request.param], env)
    for s in samples:
        producer.write(s)
    producer.flush()  # a live source's cache starts empty: it reads what the producer published
    live = LiveConfig(endpoint=None, on_missing="generate", request_timeout=5, mooncake=mc_cfg(env))
    src = SOURCES[request.param](store=env.store, manifest=env.manifest,
                                 prompts=Prompts(env.manifest.prepared_fingerprint, samples), live=live)
    yield request.param, src, samples
    src.close()  # close() works: every source test ends with it
    producer.close()


def test_a_source_holds_every_sample_and_reads_it_back_bit_exactly(source):
    _, src, samples = source
    assert isinstance(src, Source) and set(IDS) <= set(src.sample_ids)
    for s in samples:
        assert_same(src.read(s.sample_id), s)


def test_reads_from_four_threads_at_once_agree_bit_exactly(source):
    _, src, samples = source
    with ThreadPoolExecutor(4) as pool:  # a live source's first reads are concurrent misses
        rounds = list(pool.map(lambda _: [src.read(i) for i in IDS], range(4)))
    for got in rounds:
        for g, s in zip(got, samples):
            assert_same(g, s)


def test_fingerprint_is_stable_hex_and_live_stats_location_are_well_typed(source):
    name, src, _ = source
    fp = src.fingerprint()
    assert isinstance(fp, str) and fp and int(fp, 16) >= 0 and fp == src.fingerprint()
    assert isinstance(src.stats, dict) and src.live is LIVE[name]
    assert isinstance(src.location, str) and src.location
