"""What a save and a restore cost at a job's scale (issue 40): the bytes, the metadata, the
store requests and the time each takes, and which limit binds. Pure arithmetic, from counts
that `bench/scale.py` measures (and checks at 16 ranks) and a few rates of this machine.

The layout decides who holds and loads what (DCP saves a replicated value once, spread over
the ranks, so every rank writes S/W bytes whatever the layout):

    fsdp     every tensor sharded over all W ranks: each rank loads S/W
    hsdp:R   sharded over W/R ranks, replicated R times: each rank loads S·R/W
    ddp      replicated on every rank: each rank loads all S

Whatever the layout, the store is read once per restore: each rank reads S/W of it, and the
ranks that load the same pieces send each other what they read (`ckpt.restore.replicas`; the
small values, `ckpt.restore.shared_items`): an HSDP or DDP rank then receives the rest of what
it loads, S·R/W - S/W, over the job's network (`exchange_bandwidth` per node, gloo over TCP).

Besides bytes and requests, three terms decide the time where the job is small or the store
is fast: each rank's own CPU work (`Scale.save_cpu_s`, `restore_cpu_s`: planning, collectives,
its index; on ranks that outnumber a node's cores, they share them), the store round trips
rank 0 makes one after another (`request_latency` each), and rank 0's survey of the root
before a restore (`_survey`: the step directories kept and their manifests; the chosen one's
manifest parsed, and each rank told its part). `bench/scale.py` calibrates them on 2-8 ranks and checks the times at 16.

`.metadata` holds one entry per piece of every tensor: T·pieces of them (pieces W for FSDP,
W/R for HSDP, 1 for DDP). A restore reads instead the shared `.index` and the indexes of the
files that hold its pieces (`ckpt.restore.partial`): FSDP its own, HSDP up to R (DCP keeps
each replicated piece in one replica's file), DDP every rank's; on half the ranks that saved,
about 3. Where that is more than `MAX_INDEXES` files (DDP on many ranks), rank 0 reads
`.metadata` once and every rank unpickles it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ckpt.format.checksum import block_size
from ckpt.format.manifest import MAX_INDEXES

# Measured by bench/scale.py on 2-16 ranks of a 24-layer FSDP2 stack (48 parameter tensors,
# 144 pieces per rank with AdamW's moments; bench/results/scale.json): bytes of `.metadata` per
# piece of a tensor (its fit: 22,730 bytes more per rank for 144 pieces), of a rank's index per
# piece it holds (17.0 KB of JSON for 144 at 16 ranks, a little more on fewer: its RNG state
# and values), and of `.index` per parameter tensor (24.4 KB for 48: the values held once, every
# key's name and layout, at any W).
METADATA_ENTRY = 158.0
METADATA_PER_TENSOR = 680.0  # and per parameter tensor, whatever W (the fit's 32.6 KB for 48)
INDEX_ENTRY = 118.0
SHARED_ENTRY = 507.0
# ckpt's restricted unpickler of any metadata (pure Python: it checks every opcode) and pickling
# at the save, bytes/s, on this 2-core machine (bench/scale.py's `rates`, at 2 ranks).
UNPICKLE_RATE = 2.3e6
PICKLE_RATE = 17e6
# ckpt's index decoder (`ckpt.format.index_file`: JSON, then DCP's classes built and checked),
# bytes/s, on `.index` and a rank's index (bench/scale.py's `rates`).
INDEX_DECODE_RATE = 14.8e6
# The manifest rank 0 parses at a restore: an entry per file, a data file's with a checksum
# per block (`ckpt.format.checksum.block_size`), and the rate `Manifest.from_json` parses and
# checks it at, bytes/s. Measured on a synthetic manifest of 10,000 ranks of 98 MB (xxh3,
# 2 MiB blocks): 15.6 MB, 0.16 s. It then tells each rank its part (`ckpt.restore.view`), each
# pickled and framed for the scatter: 0.09 s of its CPU for those 10,000 ranks
# (bench/manifest_view.py), about 2 KB each; the others parse nothing. `ckpt.prepare` does both
# while the job sets up: the scatter's own sends are left (not priced, cold or prepared).
MANIFEST_PER_FILE = 145.0
MANIFEST_PER_BLOCK = 27.0
MANIFEST_PARSE_RATE = 97e6
TELL_PER_RANK_S = 9e-6
# A save's and a restore's requests besides each rank's files (lease, manifest, events,
# `.metadata` and `.index`, retention's deletes): bench/scale.py's fits, 15 + 2·N (a save
# after the first, the oldest checkpoint deleted; the first claims its step directory with
# listings, 20 + 2·N) and 15 + 2·N (the survey of a root of a few small checkpoints: its top
# level, the newest manifest's HEAD, then the whole root, which costs fewer round trips there
# than a HEAD of each).
SAVE_FIXED = 15
RESTORE_FIXED = 15
# Store round trips rank 0 makes one after another (bench/scale.py's recording proxy, in
# order). A save: the lease checked, the step directory claimed (three listings and a HEAD)
# before the ranks write; after the gather `.metadata`, `.index`, the lease again and the
# manifest, which commits. A restore: the root checked to be no step directory, the bucket, the
# lease read and taken; after the survey (`_survey`) `.index`, then each rank's index and its
# first range.
SAVE_ROUND_TRIPS = 9
RESTORE_ROUND_TRIPS = 7
# A rank's own CPU-seconds in a save and in a restore that its bytes do not decide: a fixed
# part, and a part per piece of state it holds; a save's also per byte it writes (its
# checksums and copies, and its S3 client's: over plain HTTP botocore signs every body with
# SHA-256, about a third of it; done as its writer process streams the file to the store); and
# rank 0's more (a save's commit; a restore's lease, survey and `.index`), which the job waits
# for. A save is one after the first, in a running job: its writer process started, its S3
# client set up, its layout planned; the first costs FIRST_SAVE_CPU_S more, once (and rank 0
# pickles `.metadata`). A restore is a fresh process's: the store's client imported and set
# up, DCP's planning and the state dict, the collectives, its index. bench/scale.py's
# `calibration` (width 512, moto over HTTP on this machine), on 2-8 ranks: a save's mean over
# ranks fitted as a + b·bytes written (0.008 s + 3.1 ns a byte; 3.6 and 4.3 in other runs);
# a restore's mean 0.44 CPU-s; rank 0's more, the busiest rank less the mean (0.02-0.03 and
# 0.13-0.15 CPU-s); each less its 144 pieces at the probe's CPU per piece (a model of 4x the
# tensors and the same bytes, on 2 ranks, the median of 3 runs: 0-0.03 and 0.15 ms; a
# restore's was 0.25-0.31 ms while DCP's step of zeros made the optimizer's state and each
# `step` value was a torch.load of its own).
SAVE_CPU_S = 0.01
SAVE_CPU_PER_PIECE_S = 0.03e-3
SAVE_CPU_PER_BYTE_S = 3.4e-9
SAVE_CPU_RANK0_S = 0.025
FIRST_SAVE_CPU_S = 0.8  # bench/scale.py's first save, a rank's mean: 0.78-0.86 CPU-s at 2-8 ranks
RESTORE_CPU_S = 0.42
RESTORE_CPU_PER_PIECE_S = 0.15e-3
RESTORE_CPU_RANK0_S = 0.13
EARLY_RANGES = 8  # ranged GETs of a rank's own file sent as the manifest names it (Transfer.readahead)
EARLY_TRIPS = 2  # of RESTORE_ROUND_TRIPS, sent then too: its index's GET and its first range's
# A restore begun by `ckpt.prepare` while the job sets up (its process group, its model): each
# rank's store and client made, rank 0's survey made (the root checked, the lease read, the
# manifest and `.index` read and checked, the parts each rank is told made). What is left to the restore: the lease's one
# conditional write and the ranks' own early GETs (RESTORE_ROUND_TRIPS_PREPARED), no survey,
# and a rank's CPU of RESTORE_CPU_PREPARED_S and its pieces; rank 0 does no more than the
# others (its share, RESTORE_CPU_RANK0_PREPARED_S). bench/early_reads.py --feature prepare
# (2 ranks, moto on loopback, median of 7) and bench/scale.py's calibration (the mean over
# ranks at 2-8): a rank's CPU after entering, less its 144 pieces at their measured rate,
# 0.13 and 0.11 s (early_reads, with and before rank 0's second look at the root; 0.15 and
# 0.13 s in all, against 0.61 and 0.56 s cold) and 0.11 and 0.085 s (scale.py, before and
# with it): their median, 0.11 s. Rank 0's no more than the mean.
RESTORE_CPU_PREPARED_S = 0.11
RESTORE_CPU_RANK0_PREPARED_S = 0.0
RESTORE_ROUND_TRIPS_PREPARED = 1 + EARLY_TRIPS
# Rank 0's survey before a restore: a LIST answers at most LIST_PAGE keys; the HEADs, GETs and
# pages of one step directory go PARALLEL at a time (`Store.each`). A listed key costs the
# client about 70 µs of one core: a page of 1,000 took 74 ms of CPU through ckpt's S3 client
# (moto on loopback, this machine), 53 ms of it botocore's XML parser; the pages sent together
# are parsed on one event loop, one after another.
LIST_PAGE = 1000
PARALLEL = 16
LIST_KEY_PARSE_S = 70e-6
# S3's request rates per prefix (a partition of the key space) until it has split it.
PUT_PER_S = 3500.0
GET_PER_S = 5500.0
MiB = 1 << 20


@dataclass(frozen=True)
class Scale:
    """A job's layout and its store: what `at_scale` needs besides the checkpoint's size."""

    world: int
    nodes: int
    tensors: int  # the model's parameter tensors (Llama 3 8B: 291, 70B: 723, 405B: 1,137)
    layout: str = "fsdp"  # fsdp, ddp, or hsdp:R
    write_bandwidth: float = 2e9  # per node, bytes/s
    read_bandwidth: float = 2e9
    exchange_bandwidth: float = 12.5e9  # per node, between nodes: what the replicas send each other
    store_bandwidth: float = math.inf  # all nodes together, bytes/s (the store's own bound)
    prefixes: int = 1  # partitions S3 spreads the step directory over (1 until it splits)
    part_size: int = 64 * MiB  # ckpt.storage.transfer.Transfer
    read_size: int = 32 * MiB
    state_per_param: int = 3  # tensors of state per parameter tensor: the weights, Adam's two moments
    # CPU cores a node has for its ranks (a DGX H100's two 56-core CPUs): the ranks' own CPU
    # work takes its time once each, until they outnumber the cores and share them.
    cores_per_node: int = 112
    save_cpu_s: float | None = None  # a rank's CPU-seconds in a save besides its bytes (None: SAVE_CPU_S and per piece)
    save_cpu_per_byte_s: float | None = None  # and per byte it writes (None: SAVE_CPU_PER_BYTE_S)
    restore_cpu_s: float | None = None  # the same in a restore (None: RESTORE_CPU_S and per piece)
    rank0_cpu_s: tuple[float, float] | None = None  # rank 0's more in a save and a restore (None: SAVE_CPU_RANK0_S, RESTORE_CPU_RANK0_S)
    request_latency: float = 0.03  # s, one store round trip for a small object (S3: 10-50 ms)
    kept: int = 5  # checkpoints kept in the root: rank 0's survey looks at each before a restore
    prepared: bool = False  # the restore begun by `ckpt.prepare` while the job set up

    @property
    def replicas(self) -> int:
        if self.layout == "fsdp":
            return 1
        if self.layout == "ddp":
            return self.world
        if self.layout.startswith("hsdp:") and self.layout[5:].isdigit() and int(self.layout[5:]) >= 1:
            return int(self.layout[5:])
        raise ValueError(f"layout {self.layout!r}: fsdp, ddp or hsdp:R (R replicas)")


@dataclass(frozen=True)
class AtScale:
    """The predicted costs of one save and one restore (seconds, bytes, requests)."""

    saved_per_rank: float
    loaded_per_rank: float
    metadata_bytes: float  # `.metadata`
    index_bytes: float  # one rank's index
    shared_index_bytes: float  # `.index`
    save_requests: float
    restore_requests: float
    save_bytes_s: float  # the bandwidth's bound
    save_requests_s: float  # the request rate's bound
    save_metadata_s: float  # rank 0 writes `.metadata` and `.index` again (pickled at the first save)
    save_s: float  # a save after the first: what the interval is priced at
    first_save_s: float  # the first of a run: a rank's writer process starts, rank 0 pickles `.metadata`
    save_binds: str  # the largest of the save's terms
    restore_bytes_s: float
    restore_requests_s: float
    restore_exchange_s: float  # the replicas' parts, sent to each other once read
    restore_metadata_s: float  # reading and decoding this rank's metadata (its index and `.index`)
    restore_overlap_s: float  # of the bytes' time, passed while the ranks plan (their first ranges, read early)
    restore_s: float
    restore_binds: str  # the largest of the restore's terms
    save_cpu_s: float  # a rank's own CPU work, on the cores its node gives its ranks
    save_stream_s: float  # and its CPU per byte it writes, done as the bytes go (with them, the larger binds)
    save_round_trips_s: float  # rank 0's requests one after another: the step's claim, the commit
    restore_cpu_s: float
    restore_round_trips_s: float  # besides the survey: the lease, `.index`, each rank's index
    restore_survey_s: float  # rank 0's survey of the root, before the restore is planned
    survey_round_trips: int
    survey_keys: int  # listed and parsed: the step directories kept and the chosen one's files
    metadata_read: str  # what a rank reads of the metadata: indexes, or all of `.metadata`
    restore_resharded_metadata_s: float  # on half the ranks that saved: each rank's metadata


def at_scale(checkpoint_bytes: float, s: Scale) -> AtScale:
    """The costs of saving and restoring a checkpoint of `checkpoint_bytes` in layout `s`."""
    w, r = s.world, s.replicas
    if w < 1 or s.nodes < 1 or w % r:
        raise ValueError(f"{w} ranks cannot hold {r} replicas")
    per_rank = checkpoint_bytes / w
    loaded = checkpoint_bytes * r / w
    pieces = w // r  # of each sharded tensor
    entries = s.tensors * s.state_per_param
    metadata = s.tensors * METADATA_PER_TENSOR + entries * pieces * METADATA_ENTRY
    index = entries * (1 if r < w else 1 / w) * INDEX_ENTRY  # a piece of every tensor; DDP: 1/W of them
    shared = s.tensors * SHARED_ENTRY  # each parameter's optimizer step, the hyperparameters
    # Requests: each rank's data file (one PUT up to two parts, else parts + create + complete)
    # and its index; the job's few (SAVE_FIXED, RESTORE_FIXED).
    data_puts = 1 if per_rank <= 2 * s.part_size else math.ceil(per_rank / s.part_size) + 2
    save_requests = w * (data_puts + 1) + SAVE_FIXED
    restore_requests = w * (math.ceil(per_rank / s.read_size) + 1) + RESTORE_FIXED  # ranged GETs of its part, its index
    write_bw = min(s.store_bandwidth, s.nodes * s.write_bandwidth)
    read_bw = min(s.store_bandwidth, s.nodes * s.read_bandwidth)
    save_bytes_s = checkpoint_bytes / write_bw
    save_requests_s = save_requests / (PUT_PER_S * s.prefixes)
    # Rank 0 pickles `.metadata` at a save DCP plans (the first; a layout changed; a pickled
    # value that moved a tensor) and writes that image again at every save after it
    # (`ckpt.save.resave.Layout.write_metadata`).
    save_metadata_s = (metadata + shared) / s.write_bandwidth
    pickle_s = (metadata + shared) / PICKLE_RATE
    restore_bytes_s = checkpoint_bytes / read_bw  # read once, over the nodes' (or the store's) bandwidth
    restore_requests_s = restore_requests / (GET_PER_S * s.prefixes)
    restore_exchange_s = (loaded - per_rank) * (w / s.nodes) / s.exchange_bandwidth  # what a node receives
    whole_metadata_s = metadata / s.read_bandwidth + metadata / UNPICKLE_RATE
    # A rank reads the indexes of the files its pieces are in (a replicated piece is in one
    # replica's file: HSDP's R, DDP's W), in all about its own index's entries, and `.index`.
    part = index if r == 1 else entries * INDEX_ENTRY
    indexed = min(r, w) <= MAX_INDEXES
    restore_metadata_s = _index_s(part + shared, s) if indexed else whole_metadata_s
    # On half the ranks, an FSDP rank loads the pieces of 2 saving ranks (3 where they straddle).
    resharded_s = _index_s(3 * part + shared, s) if min(r, w) * 3 <= MAX_INDEXES else whole_metadata_s
    block = block_size(int(per_rank))
    manifest = w * (2 * MANIFEST_PER_FILE + (MANIFEST_PER_BLOCK * math.ceil(per_rank / block) if block else 0))
    # A rank's own CPU work, once per rank; where the ranks outnumber their node's cores, they share them.
    shared_cores = max(1.0, w / s.nodes / s.cores_per_node)
    # On cores its node's ranks share, rank 0's more comes after the others' shares: once.
    rank0_save, rank0_restore = (SAVE_CPU_RANK0_S, RESTORE_CPU_RANK0_S) if s.rank0_cpu_s is None else s.rank0_cpu_s
    save_cpu_s = shared_cores * (SAVE_CPU_S + SAVE_CPU_PER_PIECE_S * entries if s.save_cpu_s is None else s.save_cpu_s) + rank0_save
    # A rank's checksums and copies of what it writes, done as the writer streams it to the store.
    per_byte = SAVE_CPU_PER_BYTE_S if s.save_cpu_per_byte_s is None else s.save_cpu_per_byte_s
    save_stream_s = shared_cores * per_byte * per_rank
    if s.prepared and s.rank0_cpu_s is None:
        rank0_restore = RESTORE_CPU_RANK0_PREPARED_S
    fixed = RESTORE_CPU_PREPARED_S if s.prepared else RESTORE_CPU_S
    restore_cpu_s = shared_cores * (fixed + RESTORE_CPU_PER_PIECE_S * entries if s.restore_cpu_s is None else s.restore_cpu_s) + rank0_restore
    save_trips_s = SAVE_ROUND_TRIPS * s.request_latency
    # A rank's early GETs (its index, its first range) go out together: one round trip in sequence.
    trips = EARLY_TRIPS if indexed and w > 1 else EARLY_TRIPS - 1
    restore_trips_s = ((RESTORE_ROUND_TRIPS_PREPARED if s.prepared else RESTORE_ROUND_TRIPS) - max(trips - 1, 0)) * s.request_latency
    survey_s, survey_trips, survey_keys = _survey(s, manifest)
    if s.prepared:  # made while the job set up: the manifest parsed, the parts each rank is told made
        survey_s, survey_trips, survey_keys = 0.0, 0, 0
    save_s = save_cpu_s + save_trips_s + max(save_bytes_s, save_requests_s, save_stream_s) + save_metadata_s
    # A rank's own index and the first EARLY_RANGES ranges of its own file are on their way
    # from the moment the manifest names them (`Store.read_early`), while it builds its
    # template, reads its metadata and plans (its CPU per piece): their round trips and
    # transfer take no time of their own up to that work's.
    # Not where its node's ranks outnumber the cores (the transfer's CPU competes with it), nor
    # for a CPU given whole (`restore_cpu_s`, which does not say what comes after the manifest).
    read_s = max(restore_bytes_s, restore_requests_s)
    planning_s = (RESTORE_CPU_PER_PIECE_S * entries if s.restore_cpu_s is None else 0.0) + restore_metadata_s
    early = min(1.0, EARLY_RANGES * s.read_size / per_rank) if shared_cores == 1 and per_rank else 0.0
    # Its index is among them where it reads its own (an indexed layout, more than one rank).
    overlap_s = min(planning_s, early * read_s + (s.request_latency if early else 0.0))
    restore_s = restore_cpu_s + restore_trips_s + survey_s + read_s - overlap_s + restore_exchange_s + restore_metadata_s
    return AtScale(
        saved_per_rank=per_rank,
        loaded_per_rank=loaded,
        metadata_bytes=metadata,
        index_bytes=index,
        shared_index_bytes=shared,
        save_requests=save_requests,
        restore_requests=restore_requests,
        save_bytes_s=save_bytes_s,
        save_requests_s=save_requests_s,
        save_metadata_s=save_metadata_s,
        save_s=save_s,
        first_save_s=save_s + pickle_s + shared_cores * FIRST_SAVE_CPU_S,
        # The CPU per byte binds only where it outlasts the bytes it streams with (max() above).
        save_binds=_largest(
            {"bandwidth": save_bytes_s, "requests": save_requests_s, "rank 0's .metadata": save_metadata_s,
             "each rank's CPU": save_cpu_s + (save_stream_s if save_stream_s > max(save_bytes_s, save_requests_s) else 0.0),
             "round trips": save_trips_s}  # fmt: skip
        ),
        restore_bytes_s=restore_bytes_s,
        restore_requests_s=restore_requests_s,
        restore_exchange_s=restore_exchange_s,
        restore_metadata_s=restore_metadata_s,
        restore_overlap_s=overlap_s,
        restore_s=restore_s,
        restore_binds=_largest(
            {
                "bandwidth": restore_bytes_s,
                "requests": restore_requests_s,
                "the replicas' exchange": restore_exchange_s,
                "each rank's metadata": restore_metadata_s,
                "each rank's CPU": restore_cpu_s,
                "round trips": restore_trips_s,
                "rank 0's survey": survey_s,
            }
        ),
        save_cpu_s=save_cpu_s,
        save_stream_s=save_stream_s,
        save_round_trips_s=save_trips_s,
        restore_cpu_s=restore_cpu_s,
        restore_round_trips_s=restore_trips_s,
        restore_survey_s=survey_s,
        survey_round_trips=survey_trips,
        survey_keys=survey_keys,
        metadata_read="its index + .index" if indexed else ".metadata, whole",
        restore_resharded_metadata_s=resharded_s,
    )


def _survey(s: Scale, manifest: float) -> tuple[float, int, int]:
    """Rank 0's survey of the root before a restore, and what it tells the ranks of the
    manifest: its seconds, round trips and keys listed. One listing of the root's top level (a
    page per LIST_PAGE steps kept, one after another), a HEAD of each kept step's manifest
    (PARALLEL at a time), a read of the newest one or two; no step directory is listed (the
    ranks' reads find a missing file). Rank 0 parses the manifest and sends each rank its part
    (`ckpt.restore.view`: TELL_PER_RANK_S each); the others wait for it."""
    trips = math.ceil(s.kept / LIST_PAGE) + math.ceil(s.kept / PARALLEL) + 1
    keys = s.kept
    seconds = trips * s.request_latency + min(2, s.kept) * manifest / s.read_bandwidth + keys * LIST_KEY_PARSE_S
    seconds += manifest / MANIFEST_PARSE_RATE + s.world * TELL_PER_RANK_S
    return seconds, trips, keys


def _largest(terms: dict[str, float]) -> str:
    """The name of the largest term: what binds."""
    return max(terms, key=lambda k: terms[k])


def _index_s(nbytes: float, s: Scale) -> float:
    """Reading and decoding `nbytes` of indexes on one rank."""
    return nbytes / INDEX_DECODE_RATE + nbytes / s.read_bandwidth


def llama_tensors(params: float) -> int:
    """The parameter tensors of a Llama-like model of `params` parameters: 9 per layer (4
    attention, 3 MLP, 2 norms) and 3 more, with layers ≈ 0.0175·params^(1/3) (Llama 3 8B: 32
    layers, 291 tensors; 70B: 80, 723; 405B: 126, 1,137; this gives 318, 651, 1,164)."""
    return 9 * max(1, round(0.0175 * params ** (1 / 3))) + 3
