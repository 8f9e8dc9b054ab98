"""Start-up tuning of the products of 65-256 rows (executor/product_tuning.py): which tiles are tried,
which one is taken, what tile_for then hands the layers, and the choices kept on disk so that a
machine times once. The timing itself needs a GPU (tests/gpu/test_product_tuning_gpu.py)."""
import json
from types import SimpleNamespace

import pytest
import torch

import batchgen.executor.product_tuning as tuning
import batchgen.kernels.tile_gemm as tg
from batchgen.executor.kv_cache import KVCache

BF16 = dict(dtype=torch.bfloat16)
GATE_UP, O, DOWN, QKV = (16384, 2048), (2048, 2048), (2048, 8192), (3072, 2048)  # llama-3.2-1b's


@pytest.fixture
def tuned_table(monkeypatch):
    """tile_for as on a Hopper GPU, with an empty table of tuned choices."""
    monkeypatch.setattr(tg, "tile_gemm_supported", lambda device: True)
    monkeypatch.setattr(tg, "tuned", {})
    return tg.tuned


def test_sizes_between_the_fixed_rule_and_the_limit():
    assert tuning.tuned_sizes(256, 8192) == [80, 96, 112] + list(range(128, 257, 8))  # (the decode ladder)
    assert tuning.tuned_sizes(96, 8192) == [80, 96, 128, 192, 256]  # (step graphs of 128, 192, 256 tokens)
    assert tuning.tuned_sizes(64, 64) == []


def test_choose_the_fastest_tile_under_the_margin():
    a, b = (128, 64, 128, 3, 8, 4), (128, 128, 128, 3, 8, 4)
    assert tuning.choose(10.0, {a: 9.0, b: 8.5}) == b
    assert tuning.choose(10.0, {a: 9.8}) is None  # faster, but within the margin: cuBLAS stays
    assert tuning.choose(10.0, {}) is None


def test_candidate_tiles():
    """128-row tiles, and up to 192 rows 64-row ones; plain products split K in the most parts that
    keep one program an SM."""
    assert tg.candidate_tiles(192, 2048, 8192, False) == [(128, 128, 128, 3, 8, 4), (128, 64, 128, 3, 8, 2),
                                                          (64, 64, 128, 5, 4, 1)]
    assert tg.candidate_tiles(96, 2048, 2048, False) == [(128, 128, 128, 3, 8, 4), (128, 64, 128, 3, 8, 4),
                                                         (64, 64, 128, 5, 4, 2)]
    assert tg.candidate_tiles(96, 8192, 2048, True)[-1] == (64, 64, 128, 3, 4, 1)
    assert tg.candidate_tiles(256, 8192, 2048, True) == [(128, 128, 64, 4, 8, 1), (128, 64, 128, 3, 8, 1)]
    # (4864 = 38 BK)
    assert tg.candidate_tiles(256, 896, 4864, False) == [(128, 128, 128, 3, 8, 2), (128, 64, 128, 3, 8, 2)]
    assert tg.candidate_tiles(100, 64, 2040, False) == []  # K not whole BK steps
    for m, n, k, silu in [(80, 2048, 8192, False), (256, 8192, 2048, True), (144, 896, 896, False)]:
        for bm, bn, bk, stages, _, split in tg.candidate_tiles(m, n, k, silu):
            assert k % (bk * split) == 0
            assert stages * (bm + bn * (2 if silu else 1)) * bk * 2 <= 200 * 1024  # shared memory of a program


def test_tile_for_above_64_rows_takes_the_tuned_choice(tuned_table):
    rows = {m: torch.empty(m, 2048, **BF16) for m in (64, 65, 192, 256, 257)}
    o, gate_up = torch.empty(*O, **BF16), torch.empty(*GATE_UP, **BF16)
    tile = (128, 64, 128, 3, 8, 4)
    tuned_table[tg.product_key(rows[192], o, False, True)] = tile
    tuned_table[tg.product_key(rows[256], gate_up, True, False)] = None  # timed: cuBLAS was faster
    assert tg.tile_for(rows[192], o, parts_ok=True) == tile
    assert tg.tile_for(rows[192], o) is None  # (a caller that cannot sum parts: never a split tile)
    assert tg.tile_for(rows[65], o, parts_ok=True) is None  # not timed
    assert tg.tile_for(rows[256], gate_up, silu_mul_out=True) is None
    assert tg.tile_for(rows[64], o, parts_ok=True) == tg.pick_tile(64, 2048, 2048, False, True)  # the fixed rule
    tuned_table[(*O, "bfloat16", False, True, 257)] = tile
    assert tg.tile_for(rows[257], o, parts_ok=True) is None  # past TUNED_MAX_ROWS


def test_recording_the_products_a_forward_asks_about(tuned_table):
    x, x_small = torch.empty(96, 2048, **BF16), torch.empty(8, 2048, **BF16)
    layers = [(torch.empty(*O, **BF16), torch.empty(*GATE_UP, **BF16), torch.empty(*QKV, **BF16)) for _ in range(3)]
    with tg.recording_products() as seen:
        for o, gate_up, qkv in layers:
            tg.tile_for(x, o, parts_ok=True)
            tg.tile_for(x, gate_up, silu_mul_out=True)
            tg.tile_for(x, qkv)  # never the tile kernel's: not asked about
            tg.tile_for(x_small, o, parts_ok=True)  # the fixed rule's rows
    tg.tile_for(x, layers[0][0], parts_ok=True)  # after: not recorded
    assert set(seen) == {(*O, "bfloat16", False, True), (*GATE_UP, "bfloat16", True, False)}
    assert [w for w in seen[(*O, "bfloat16", False, True)].values()] == [o for o, _, _ in layers]


class FakeModel:
    """Asks tile_for about an o and a gate/up of two layers, at the batch's token count."""

    def __init__(self):
        self.weights = [(torch.empty(*O, **BF16), torch.empty(*GATE_UP, **BF16)) for _ in range(2)]

    def __call__(self, fb):
        x = torch.empty(fb.input_ids.shape[0], 2048, **BF16)
        for o, gate_up in self.weights:
            tg.tile_for(x, o, parts_ok=True)
            tg.tile_for(x, gate_up, silu_mul_out=True)


def fake_runner(max_num_seqs=96):
    kv = KVCache(1, 512, 1, 8, max_num_seqs, 512, torch.float32, torch.device("cpu"))
    return SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=8192,
                           kv=kv, device=torch.device("cpu"), model=FakeModel())


def test_tune_once_then_keep_the_choices(tuned_table, monkeypatch, tmp_path):
    """The first start times every (shape, size) and writes the choices; the next reads them and times
    nothing; another GPU model (or software version) times its own."""
    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(tuning, "machine_tag", lambda device: "GPU A")
    timed = []

    def time_choice(weights, m, silu_mul_out, parts_ok):
        timed.append((weights[0].shape, m))
        assert len(weights) == 2 and parts_ok != silu_mul_out
        return tg.candidate_tiles(m, weights[0].shape[0] // (2 if silu_mul_out else 1), weights[0].shape[1],
                                  silu_mul_out)[0] if m >= 192 else None

    monkeypatch.setattr(tuning, "time_choice", time_choice)
    runner = fake_runner()
    tuning.tune_products(runner)
    sizes = [80, 96, 128, 192, 256]
    assert sorted(timed) == sorted((torch.Size(s), m) for s in (O, GATE_UP) for m in sizes)
    assert tuned_table[(*O, "bfloat16", False, True, 192)] == (128, 128, 128, 3, 8, 4)
    assert tuned_table[(*GATE_UP, "bfloat16", True, False, 80)] is None
    assert (runner.kv.req_to_token[:-1] == 0).all()  # the synthetic step's token table entries cleared
    kept = json.loads((tmp_path / "tuned_products.json").read_text())
    assert len(kept) == 10 and all(name.startswith("GPU A | ") for name in kept)

    timed.clear()
    tuned_table.clear()
    tuning.tune_products(fake_runner())
    assert timed == [] and len(tuned_table) == 10
    assert tuned_table[(*O, "bfloat16", False, True, 256)] == (128, 128, 128, 3, 8, 4)

    name = next(n for n in kept if n.endswith(",192"))  # an entry no start wrote: timed again
    kept[name] = "fast"
    (tmp_path / "tuned_products.json").write_text(json.dumps(kept))
    tuning.tune_products(fake_runner())
    assert len(timed) == 1 and json.loads((tmp_path / "tuned_products.json").read_text())[name] is not None
    timed.clear()

    monkeypatch.setattr(tuning, "machine_tag", lambda device: "GPU B")
    tuning.tune_products(fake_runner())
    assert len(timed) == 10 and len(json.loads((tmp_path / "tuned_products.json").read_text())) == 20


def test_nothing_to_tune(tuned_table, monkeypatch, tmp_path):
    """No sizes above 64 rows, or no product the tile kernel could take: no forward, no timing, no file."""
    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(tuning, "time_choice", lambda *a: pytest.fail("timed"))
    runner = fake_runner(max_num_seqs=16)
    runner.max_num_batched_tokens = 64
    tuning.tune_products(runner)
    runner = fake_runner()
    runner.model.weights = []
    tuning.tune_products(runner)
    assert tuned_table == {} and not (tmp_path / "tuned_products.json").exists()


def test_timing_weights_pass_the_l2():
    """Enough layers' weights that a graph of them reads 256 MB (each from DRAM), at least two."""
    layers = lambda shape, count: [torch.empty(*shape, **BF16) for _ in range(count)]  # noqa: E731
    assert len(tuning.timing_weights(layers(O, 16))) == 16  # 8 MB each: all there are
    assert len(tuning.timing_weights(layers(GATE_UP, 16))) == 4  # 64 MB each
    assert len(tuning.timing_weights(layers((28672, 4096), 32))) == 2  # llama-3.1-8b's gate/up, 224 MB


def test_kept_values():
    assert tuning.is_choice(None) and tuning.is_choice([128, 64, 128, 3, 8, 4])
    assert not any(tuning.is_choice(v)
                   for v in ("", [128, 64, 128, 3, 8], [128, 64, 128, 3, 8, 0.5], [1] * 5 + [True], {}))


def test_unreadable_or_unwritable_choices(tmp_path, caplog):
    path = tmp_path / "tuned_products.json"
    path.write_text("{not json")
    assert tuning.load_choices(path) == {}
    path.write_text("[1, 2]")
    assert tuning.load_choices(path) == {}
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    tuning.save_choices(blocked / "tuned_products.json", {"x": None})  # its folder cannot be made: a warning
    assert "times them again" in caplog.text
    tuning.save_choices(path, {"x": [1, 2]})
    assert tuning.load_choices(path) == {"x": [1, 2]} and list(tmp_path.glob("*.tmp")) == []
