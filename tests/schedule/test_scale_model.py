"""`ckpt plan` at scale (`ckpt.schedule.scale_model`, issue 40): what grows with the world size
and what does not, by layout, and which limit binds. Its constants come from bench/scale.py."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from ckpt.format.manifest import MAX_INDEXES
from ckpt.schedule.scale_model import (
    EARLY_RANGES,
    EARLY_TRIPS,
    LIST_KEY_PARSE_S,
    METADATA_ENTRY,
    METADATA_PER_TENSOR,
    PICKLE_RATE,
    RESTORE_CPU_PER_PIECE_S,
    RESTORE_CPU_PREPARED_S,
    RESTORE_CPU_RANK0_PREPARED_S,
    RESTORE_CPU_RANK0_S,
    RESTORE_FIXED,
    RESTORE_ROUND_TRIPS,
    RESTORE_ROUND_TRIPS_PREPARED,
    SAVE_CPU_RANK0_S,
    SAVE_ROUND_TRIPS,
    UNPICKLE_RATE,
    Scale,
    at_scale,
    llama_tensors,
)
from tests.support.cli import ckpt_cli

GB = 1e9
SEVENTY_B = 70e9 * 14  # bytes: BF16 weights, FP32 Adam moments and master weights


def test_metadata_grows_with_the_ranks_that_shard_a_tensor_and_a_ranks_part_does_not():
    by_world = {w: at_scale(SEVENTY_B, Scale(world=w, nodes=w // 8, tensors=723)) for w in (1024, 8192)}
    assert by_world[8192].metadata_bytes == pytest.approx(8 * by_world[1024].metadata_bytes, rel=0.01)
    assert by_world[8192].metadata_bytes == pytest.approx(723 * 3 * 8192 * METADATA_ENTRY, rel=0.01)
    assert by_world[8192].index_bytes == by_world[1024].index_bytes  # a piece of every tensor, whatever W
    assert by_world[8192].shared_index_bytes == by_world[1024].shared_index_bytes
    ddp = at_scale(8 * 14e9, Scale(world=64, nodes=8, tensors=291, layout="ddp"))
    hsdp = at_scale(SEVENTY_B, Scale(world=8192, nodes=1024, tensors=723, layout="hsdp:8"))
    assert ddp.metadata_bytes == pytest.approx(291 * (3 * METADATA_ENTRY + METADATA_PER_TENSOR))  # one piece of each: no growth
    assert hsdp.metadata_bytes == pytest.approx(by_world[8192].metadata_bytes / 8, rel=0.01)
    assert ddp.loaded_per_rank == pytest.approx(8 * 14e9) and hsdp.loaded_per_rank == pytest.approx(8 * SEVENTY_B / 8192)
    # a replicated piece lies in one replica's file: an HSDP rank reads the indexes of its R
    # replicas, about one index's entries in all; a DDP rank on more than MAX_INDEXES ranks,
    # .metadata (small: one piece of each tensor)
    assert hsdp.restore_metadata_s == pytest.approx(by_world[8192].restore_metadata_s, rel=0.01)
    wide = at_scale(8 * 14e9, Scale(world=MAX_INDEXES + 8, nodes=9, tensors=291, layout="ddp"))
    assert wide.restore_metadata_s == pytest.approx(wide.metadata_bytes / UNPICKLE_RATE, rel=0.05)
    # on half the ranks: the indexes of the 2 or 3 saving ranks whose pieces a rank loads
    assert by_world[8192].restore_resharded_metadata_s < 4 * by_world[8192].restore_metadata_s
    # replicas read the store once between them (S in all), then send each other their parts
    assert hsdp.restore_bytes_s == pytest.approx(by_world[8192].restore_bytes_s) and by_world[8192].restore_exchange_s == 0
    assert hsdp.restore_exchange_s == pytest.approx(8 * (8 - 1) * SEVENTY_B / 8192 / 12.5e9)
    assert ddp.restore_requests == 64 * (math.ceil(8 * 14e9 / 64 / (32 << 20)) + 1) + RESTORE_FIXED  # the GETs of its part, not of all S


def test_a_restore_on_many_ranks_is_bound_by_the_stores_request_rate_until_it_spreads_over_prefixes():
    base = dict(world=10_000, nodes=1250, tensors=723, read_bandwidth=12.5 * GB, write_bandwidth=12.5 * GB, store_bandwidth=1000 * GB)
    one = at_scale(SEVENTY_B, Scale(**base))
    assert one.restore_binds == "requests" and one.restore_requests_s > 5 * one.restore_bytes_s
    spread = at_scale(SEVENTY_B, Scale(**base, prefixes=100))
    assert spread.restore_requests_s == pytest.approx(one.restore_requests_s / 100) and spread.restore_requests_s < spread.restore_bytes_s
    assert spread.restore_binds == "bandwidth"  # then each rank's CPU, this machine's (below)
    assert spread.restore_metadata_s < 0.25 * spread.restore_bytes_s  # the index keeps a rank's metadata small
    assert spread.restore_resharded_metadata_s < 4 * spread.restore_metadata_s  # a few indexes on half the ranks
    few = at_scale(SEVENTY_B, Scale(world=64, nodes=8, tensors=723, write_bandwidth=1 * GB))
    assert few.save_binds == "bandwidth" and few.save_requests > 64  # several parts per file
    # At 2.5 GB/s a node's 8 ranks checksum and send their 15 GB each slower than the node's
    # link takes them, at this machine's CPU per byte written.
    fast = at_scale(SEVENTY_B, Scale(world=64, nodes=8, tensors=723, write_bandwidth=2.5 * GB))
    assert fast.save_binds == "each rank's CPU" and fast.save_stream_s > fast.save_bytes_s


def test_what_binds_a_save_is_a_term_that_moves_its_time():
    """The CPU per byte runs under the bytes (max()): where the bandwidth takes longer, the save
    is the bandwidth's, whatever the fixed CPU adds beside it (outside review of 4195ea5)."""
    base = dict(world=64, nodes=8, tensors=723, write_bandwidth=1.8 * GB, save_cpu_s=10.0)
    a = at_scale(SEVENTY_B, Scale(**base))
    assert a.save_bytes_s > a.save_stream_s > 0
    assert at_scale(SEVENTY_B, Scale(**base, save_cpu_per_byte_s=0.0)).save_s == a.save_s
    assert a.save_binds == "bandwidth", a.save_binds


def test_ckpt_plan_takes_the_cpu_per_byte_and_refuses_a_negative_one():
    args = ("plan", "--params", "7B", "--nodes", "1", "--gpus-per-node", "1", "--write-bandwidth", "2GB/s", "--mtbf", "3h", "--json")
    measured = json.loads(ckpt_cli(*args).stdout)["at_scale"]
    none = json.loads(ckpt_cli(*args, "--cpu-per-byte", "0").stdout)["at_scale"]
    assert measured["save_binds"] == "each rank's CPU" and none["save_binds"] == "bandwidth"
    assert none["save_stream_s"] == 0 and none["save_s"] < measured["save_s"]
    bad = ckpt_cli(*args, "--cpu-per-byte", "-1", check=False)
    assert bad.returncode != 0 and "--cpu-per-byte" in bad.stderr


def test_a_bad_layout_is_refused_saying_what_is_allowed():
    with pytest.raises(ValueError, match="fsdp, ddp or hsdp:R"):
        at_scale(GB, Scale(world=8, nodes=1, tensors=10, layout="zero3"))
    with pytest.raises(ValueError, match="cannot hold 3 replicas"):
        at_scale(GB, Scale(world=8, nodes=1, tensors=10, layout="hsdp:3"))


def test_llama_like_tensor_counts_are_near_llama_3s():
    for params, tensors in ((8e9, 291), (70e9, 723), (405e9, 1137)):
        assert abs(llama_tensors(params) - tensors) / tensors < 0.12


def test_plan_prints_the_scale_table_and_its_json():
    args = ("plan", "--params", "70B", "--nodes", "1250", "--write-bandwidth", "12.5GB/s", "--mtbf", "3h")
    out = ckpt_cli(*args, "--layout", "hsdp:8").stdout
    assert "at 10000 ranks (hsdp:8)" in out and ".metadata" in out and "(bound by " in out
    doc = json.loads(ckpt_cli(*args, "--json").stdout)
    assert doc["at_scale"]["restore_binds"] == "requests" and doc["at_scale"]["loaded_per_rank"] > 0
    bad = ckpt_cli(*args, "--layout", "zero3", check=False)
    assert bad.returncode != 0 and "fsdp, ddp or hsdp:R" in bad.stderr


def test_what_binds_is_the_largest_term_and_ddp_at_scale_says_it_reads_metadata_whole():
    """At 10,000 ranks the first 70B save is minutes longer than the next: rank 0 pickles
    `.metadata` (3 GB); the saves after it write that image again and are bound by the
    requests on one prefix. A DDP restore past the indexes' reach reads `.metadata` whole, and
    says so (outside review of issue 40)."""
    fsdp = at_scale(980e9, Scale(world=10_000, nodes=1250, tensors=723, write_bandwidth=12.5e9, read_bandwidth=12.5e9, store_bandwidth=1e12))
    assert fsdp.first_save_s - fsdp.save_s == pytest.approx(fsdp.metadata_bytes / PICKLE_RATE, rel=0.01) and fsdp.first_save_s > 120
    assert fsdp.save_binds == "requests" and fsdp.save_metadata_s == pytest.approx(fsdp.metadata_bytes / 12.5e9, rel=0.01)
    assert fsdp.metadata_read == "its index + .index"
    ddp = at_scale(980e9, Scale(world=10_000, nodes=1250, tensors=723, layout="ddp", write_bandwidth=12.5e9, read_bandwidth=12.5e9, store_bandwidth=1e12))
    assert ddp.metadata_read == ".metadata, whole" and ddp.restore_binds == "the replicas' exchange"


def test_ckpt_plan_says_when_what_a_rank_loads_cannot_fit_in_a_gpu():
    ddp = ckpt_cli("plan", "--params", "70B", "--nodes", "1250", "--write-bandwidth", "12.5GB/s", "--mtbf", "3h", "--layout", "ddp", check=True).stdout
    assert "\nnote: each rank of this layout holds 980.0 GB" in ddp and "\\n" not in ddp, ddp  # a line of its own, not an escaped newline
    fsdp = ckpt_cli("plan", "--params", "70B", "--nodes", "1250", "--write-bandwidth", "12.5GB/s", "--mtbf", "3h", check=True).stdout
    assert "note:" not in fsdp, fsdp


def test_a_restore_prices_the_manifest_rank_0_parses_and_tells_each_rank_its_part_of():
    """Rank 0 parses the manifest at a restore (an entry per file and a checksum per block of a
    data file: 15.6 MB for 70B on 10,000 ranks, measured on a synthetic one: 0.16 s) and tells
    each rank its part (`ckpt.restore.view`, 5 µs a rank), while the others wait; no other rank
    parses it (before, every rank was sent it whole)."""
    from ckpt.schedule.scale_model import MANIFEST_PARSE_RATE, TELL_PER_RANK_S

    big = at_scale(980e9, Scale(world=10_000, nodes=1250, **CLUSTER))
    small = at_scale(980e9, Scale(world=8, nodes=1, **CLUSTER))
    told_s = big.restore_survey_s - small.restore_survey_s
    assert 15e6 / MANIFEST_PARSE_RATE + 9_992 * TELL_PER_RANK_S < told_s < 17e6 / MANIFEST_PARSE_RATE + 10_000 * TELL_PER_RANK_S + 0.01, told_s
    assert big.restore_metadata_s < 0.05  # a rank's own index and `.index`: no manifest


CLUSTER = dict(tensors=723, write_bandwidth=12.5e9, read_bandwidth=12.5e9, store_bandwidth=1e12, prefixes=100)


@pytest.mark.parametrize(
    ("world", "nodes", "cores", "shared"),
    [(10_000, 1250, 112, 1), (10_000, 1250, 8, 1), (10_000, 1250, 4, 2), (16, 1, 2, 8), (8, 1, 2, 4), (2, 1, 2, 1)],
)
def test_a_ranks_cpu_takes_its_own_time_until_the_ranks_outnumber_their_nodes_cores(world, nodes, cores, shared):
    """A node's ranks share its cores only when there are more of them: 8 GPUs on 112 (or 8)
    cores cost a rank's CPU once, the same job on 4 cores twice, 16 ranks on 2 cores 8 times."""
    own = at_scale(SEVENTY_B, Scale(world=world, nodes=nodes, **CLUSTER, cores_per_node=10**6))
    got = at_scale(SEVENTY_B, Scale(world=world, nodes=nodes, **CLUSTER, cores_per_node=cores))
    # Each rank's share of the cores, then rank 0's more (its commit; its lease and survey) once.
    a_rank = own.save_cpu_s - SAVE_CPU_RANK0_S, own.restore_cpu_s - RESTORE_CPU_RANK0_S
    assert got.save_cpu_s == pytest.approx(shared * a_rank[0] + SAVE_CPU_RANK0_S)
    assert got.restore_cpu_s == pytest.approx(shared * a_rank[1] + RESTORE_CPU_RANK0_S)
    # On shared cores the first ranges' transfer competes with the planning: no overlap then.
    assert got.restore_s - own.restore_s == pytest.approx((shared - 1) * a_rank[1] + (own.restore_overlap_s if shared > 1 else 0.0))
    assert own.restore_overlap_s > 0 and (got.restore_overlap_s == 0) == (shared > 1)
    if shared == 1:
        assert got == own  # the default's cores change nothing on a cluster's node of 8 GPUs
    given = at_scale(SEVENTY_B, Scale(world=world, nodes=nodes, **CLUSTER, cores_per_node=cores, save_cpu_s=2.0, restore_cpu_s=0.5, rank0_cpu_s=(0.0, 0.3)))
    assert (given.save_cpu_s, given.restore_cpu_s) == pytest.approx((2.0 * shared, 0.5 * shared + 0.3))


@pytest.mark.parametrize(
    ("params", "world", "store_bandwidth", "covered"),
    [("70B", 10_000, 1e12, "planning"), ("70B", 10_000, 20e9, "planning"), ("405B", 1_000, 1e12, "first ranges"), ("8B", 1_000, 2e12, "bytes")],
)
def test_a_ranks_first_ranges_arrive_while_it_plans_up_to_the_shorter_of_the_two(params, world, store_bandwidth, covered):
    """A rank's own index and its own file's first EARLY_RANGES ranges are read from the moment
    the manifest names them: the restore is shorter by its planning (CPU per piece and its
    metadata), by their round trip (the two GETs go together) and the time of those ranges
    where they are a part of its file, or by the round trip and the bytes' time if all come
    sooner."""
    size = {"8B": 8e9 * 14, "70B": SEVENTY_B, "405B": 405e9 * 14}[params]
    scale = Scale(world=world, nodes=world // 8, **{**CLUSTER, "store_bandwidth": store_bandwidth, "tensors": llama_tensors(float(params[:-1]) * 1e9)})
    got = at_scale(size, scale)
    planning = RESTORE_CPU_PER_PIECE_S * scale.tensors * scale.state_per_param + got.restore_metadata_s
    read = max(got.restore_bytes_s, got.restore_requests_s)
    trips = scale.request_latency  # its index's GET and its first range's, sent together
    first = min(1.0, EARLY_RANGES * scale.read_size / got.saved_per_rank) * read + trips
    assert got.restore_overlap_s == pytest.approx(min(planning, first))
    assert {"planning": planning, "first ranges": first, "bytes": read + trips}[covered] == pytest.approx(got.restore_overlap_s)
    whole = at_scale(size, dataclasses.replace(scale, restore_cpu_s=0.5))  # a CPU given whole says no planning apart
    assert whole.restore_overlap_s == pytest.approx(min(got.restore_metadata_s, first))


def test_rank_0s_round_trips_are_priced_one_after_another_at_the_stores_latency():
    fast, slow = (at_scale(SEVENTY_B, Scale(world=10_000, nodes=1250, **CLUSTER, request_latency=t)) for t in (0.0, 0.05))
    assert slow.save_round_trips_s == pytest.approx(SAVE_ROUND_TRIPS * 0.05) and fast.save_round_trips_s == 0
    # A rank's own early GETs (its index, its first range) go out together: one round trip.
    in_turn = RESTORE_ROUND_TRIPS - (EARLY_TRIPS - 1)
    assert slow.restore_round_trips_s == pytest.approx(in_turn * 0.05)
    assert slow.save_s - fast.save_s == pytest.approx(SAVE_ROUND_TRIPS * 0.05)
    assert slow.restore_s - fast.restore_s == pytest.approx((in_turn + slow.survey_round_trips) * 0.05)


@pytest.mark.parametrize(
    ("world", "kept", "trips", "keys"),
    [
        (8, 5, 1 + 1 + 1, 5),  # one page of the root, 5 HEADs at once, the newest manifests
        (10_000, 5, 1 + 1 + 1, 5),  # no step directory listed, whatever its files
        (16_000, 5, 1 + 1 + 1, 5),
        (10_000, 1000, 1 + 63 + 1, 1000),  # 1,000 HEADs, 16 at a time
        (10_000, 1001, 2 + 63 + 1, 1001),  # the root's listing needs a second page
    ],
)
def test_rank_0s_survey_grows_with_the_steps_kept_not_with_the_ranks(world, kept, trips, keys):
    """Before a restore rank 0 lists the root's top level (a page per 1,000 steps kept, one
    after another), HEADs each kept manifest and reads the newest (16 at a time); no step
    directory is listed (its 2·W + 3 files were 1.4 s of rank 0's CPU at 10,000 ranks)."""
    s = Scale(world=world, nodes=max(1, world // 8), **CLUSTER, kept=kept, request_latency=0.03)
    got = at_scale(SEVENTY_B, s)
    assert (got.survey_round_trips, got.survey_keys) == (trips, keys)
    free = at_scale(SEVENTY_B, Scale(world=world, nodes=max(1, world // 8), **{**CLUSTER, "read_bandwidth": math.inf}, kept=kept, request_latency=0.0))
    # What is left: rank 0's parse of the manifest and the parts it tells, about 21 µs a rank
    # for 70B (an entry of 1.6 KB each, parsed at 97 MB/s, and 5 µs to tell).
    told = free.restore_survey_s - keys * LIST_KEY_PARSE_S
    assert 15e-6 * world < told < 30e-6 * world, told
    assert got.restore_survey_s - free.restore_survey_s > trips * 0.03  # the round trips, and the manifests' bytes


def test_the_survey_of_a_70b_job_on_10000_gpus_is_its_round_trips_and_the_manifest():
    """3 round trips at 30 ms, two manifests of 15.6 MB at a node's 12.5 GB/s, rank 0's parse of
    one (0.16 s) and the parts it tells, pickled and framed (0.09 s): 0.34 s. The store's bandwidth binds the
    restore, with each rank's own CPU at this machine's rate close behind."""
    got = at_scale(SEVENTY_B, Scale(world=10_000, nodes=1250, **CLUSTER))
    assert got.survey_round_trips == 3 and got.survey_keys == 5
    assert got.restore_survey_s == pytest.approx(3 * 0.03 + 2 * 15.6e6 / 12.5e9 + 15.6e6 / 97e6 + 0.09, abs=0.02)
    assert got.restore_binds == "bandwidth" and got.restore_s > 1.2 * got.restore_bytes_s


def test_ckpt_plan_prints_the_survey_and_each_ranks_cpu_and_takes_their_inputs():
    args = ("plan", "--params", "70B", "--nodes", "1250", "--write-bandwidth", "12.5GB/s", "--store-bandwidth", "1TB/s", "--mtbf", "3h", "--prefixes", "100")
    out = ckpt_cli(*args).stdout
    assert "restore: rank 0's survey of the root" in out and "3 round trips, 5 keys listed" in out, out
    assert "restore: a rank's CPU / rank 0's round trips" in out and "restore, predicted" in out and "(bound by bandwidth)" in out
    assert "restore: of the bytes' time, read while the ranks plan" in out
    doc = json.loads(ckpt_cli(*args, "--kept", "2000", "--request-latency", "50ms", "--cores-per-node", "4", "--rank-cpu", "1s/0.5s", "--json").stdout)["at_scale"]
    assert doc["survey_round_trips"] == 2 + 125 + 1 and doc["survey_keys"] == 2000
    assert doc["restore_cpu_s"] == pytest.approx(2 * 0.5 + RESTORE_CPU_RANK0_S) and doc["save_cpu_s"] == pytest.approx(2 * 1.0 + SAVE_CPU_RANK0_S)
    assert doc["restore_round_trips_s"] == pytest.approx((RESTORE_ROUND_TRIPS - (EARLY_TRIPS - 1)) * 0.05)
    bad = ckpt_cli(*args, "--rank-cpu", "1s", check=False)
    assert bad.returncode == 2 and "1s/0.8s" in bad.stderr


@pytest.mark.parametrize(("layout", "world", "own_index"), [("fsdp", 1_000, True), ("ddp", 8, True), ("ddp", 128, False), ("fsdp", 1, False)])
def test_a_ranks_own_index_counts_among_its_early_reads_only_where_it_reads_its_own(layout, world, own_index):
    """DDP on more ranks than the indexes serve reads `.metadata`, one rank has no index: only
    the first range's GET is early there (outside review). Where both are, they go together:
    one round trip, early, and one fewer in turn."""
    scale = Scale(world=world, nodes=max(1, world // 8), **{**CLUSTER, "tensors": 291}, layout=layout)
    got = at_scale(8e9 * 14, scale)
    planning = RESTORE_CPU_PER_PIECE_S * scale.tensors * scale.state_per_param + got.restore_metadata_s
    read = max(got.restore_bytes_s, got.restore_requests_s)
    first = min(1.0, EARLY_RANGES * scale.read_size / got.saved_per_rank) * read
    assert got.restore_overlap_s == pytest.approx(min(planning, first + scale.request_latency))
    assert got.restore_round_trips_s == pytest.approx((RESTORE_ROUND_TRIPS - (1 if own_index else 0)) * scale.request_latency)


def test_a_restore_begun_by_prepare_leaves_the_bytes_and_each_ranks_planning():
    """`ckpt.prepare` makes the clients and rank 0's survey while the job sets up: what is
    left is a rank's CPU at the prepared rate (rank 0 no more), the lease's write and the
    early GETs' round trip, and the bytes. A 70B restore on 10,000 GPUs from a 1 TB/s store
    is then within 1.2x of the bandwidth's bound (2.1x without)."""
    scale = Scale(world=10_000, nodes=1250, **CLUSTER)
    cold = at_scale(SEVENTY_B, scale)
    got = at_scale(SEVENTY_B, dataclasses.replace(scale, prepared=True))
    assert got.restore_survey_s == 0 and got.survey_round_trips == 0
    pieces = RESTORE_CPU_PER_PIECE_S * scale.tensors * scale.state_per_param
    assert got.restore_cpu_s == pytest.approx(RESTORE_CPU_PREPARED_S + pieces + RESTORE_CPU_RANK0_PREPARED_S)
    assert got.restore_round_trips_s == pytest.approx((RESTORE_ROUND_TRIPS_PREPARED - (EARLY_TRIPS - 1)) * scale.request_latency)
    assert got.restore_bytes_s == cold.restore_bytes_s and got.restore_overlap_s == cold.restore_overlap_s
    assert got.restore_s < 1.2 * got.restore_bytes_s < cold.restore_s / 1.6
    # Where the store is slower, what is left weighs less still; the save is as before.
    slow = at_scale(SEVENTY_B, dataclasses.replace(scale, prepared=True, store_bandwidth=180e9))
    assert slow.restore_s < 1.05 * slow.restore_bytes_s and got.save_s == cold.save_s
    out = ckpt_cli("plan", "--params", "70B", "--nodes", "1250", "--write-bandwidth", "12.5GB/s", "--store-bandwidth", "1TB/s", "--mtbf", "3h", "--prefixes", "100", "--json").stdout
    doc = json.loads(out)
    assert doc["at_scale_prepared"]["restore_s"] < 1.2 * doc["at_scale_prepared"]["restore_bytes_s"] < doc["at_scale"]["restore_s"]
