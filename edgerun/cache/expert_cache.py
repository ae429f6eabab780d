"""The expert cache: per-layer slot pools filled from a bundle's expert files.

Bookkeeping (which expert is in which slot, recency, generations) is :mod:`edgerun.cache.slots`;
this module moves bytes: a layer's misses are all submitted to the :class:`BlockReader` before
the first is awaited, each read lands in an owned staging buffer and is copied into its slot.
Every slot is the same fixed-size storage, so a refill is one copy and slots are interchangeable.

Where the slots live (``pool``):

- ``host``: CPU memory (the CPU engine); a read's staging buffer is copied into the slot.
- ``device``: device memory (a discrete GPU's VRAM). A read's staging buffer (page-locked) is
  copied into the slot on a side stream that first waits for the compute stream, so a slot is
  never overwritten while a queued kernel may still read its previous expert.
- ``mapped``: page-locked host memory the GPU reads directly (unified memory: Jetson, where host
  memory *is* device memory). Reads land in the slot itself, no staging copy; before a layer's
  reads start, the compute stream is drained so no queued kernel reads a slot being refilled.

Every block read is checked against its manifest checksum on the host bytes, in the reader's
thread, before it is copied to (or counted as filled in) its slot (``Bundle.check_block``); a
block that fails on a read and a re-read is not cached: its fill is abandoned, the error counted
and raised. An older bundle without checksums is read unchecked, as a counted fallback.

Prefetch (``prefetch``): reads started before a layer's lookup asks for them land in staging
buffers the reader keeps owned (``BlockReader.stage``), not in slots; the layer's next fill
places the ones it needs and drops the rest, counted as useful and wasted. The slot books never
see a prefetch, so no referenced slot is refilled early and hits and misses are the same with
prefetch on or off (the simulator's numbers); only the time a lookup waits changes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, fields, replace
from functools import partial
from typing import Any

import torch

from edgerun.bundle.reader import Bundle
from edgerun.cache.policy import CACHE_POLICIES, DEFAULT_POLICY, PREFETCH_AHEAD, PrefetchGate, held_policy
from edgerun.cache.reader import ALIGN, BlockReader, Target, aligned_buffer, disk_of
from edgerun.cache.slots import Fill, LayerSlots, QuotaError, SlotRef
from edgerun.config import CacheConfig
from edgerun.errors import ChecksumError, ConfigError, StorageError
from edgerun.kernels.moe_reference import FarTier


@dataclass
class LayerStats:
    hits: int = 0  # hits, misses and evictions are the slot table's counters
    misses: int = 0
    evictions: int = 0
    passed: int = 0  # misses read into a spill row, used and not held (lfu-bypass): among the misses
    warm_reads: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0  # wall time this layer waited for its misses
    tier_copies: int = 0  # misses served from the pinned host tier (a copy, no storage read)
    far_reads: int = 0  # (token, expert) pairs the GPU served in place from the pinned host tier
    cpu_pairs: int = 0  # (token, expert) pairs of a far tier computed on the CPU (engine/cpu_experts.py)
    prefetch_issued: int = 0  # reads started before the layer's lookup asked (``ExpertCache.prefetch``)
    prefetch_useful: int = 0  # of them, misses they served (still counted as misses)
    prefetch_wasted: int = 0  # of them, read (or cancelled) and not asked for
    prefetch_bytes: int = 0  # bytes the issued prefetches read, useful and wasted
    verify_windows: int = 0  # speculative verify windows (K + 1 rows) the layer ran
    window_experts: int = 0  # distinct experts they needed, summed (each window's union of its rows')

    @property
    def read_bandwidth(self) -> float:
        return self.bytes_read / self.read_seconds if self.read_seconds else 0.0


# CUDA's reads from a virtio disk when not set: 2 blocks in flight, each in 2 parts (4 requests at
# the disk). On the H100 machines' virtio disk a 40-layer Qwen3.6 step read its misses fastest so:
# 5.9 tok/s at an 8 GiB budget against 5.4 with 2 whole blocks and 4.3-4.7 with 4 or 8
# (docs/benchmarks.md, "Blocks in pieces"). Elsewhere (an NVMe drive, which wants more in flight;
# the CPU) one read a staging buffer, whole blocks: not measured against this.
VIRTIO_READ_DEPTH = 2
VIRTIO_READ_PIECES = 2


def read_shape(config: CacheConfig, device: torch.device, disk: str | None) -> tuple[int | None, int]:
    """(reads in flight, None: one per staging buffer; parts a block is read in) for ``config``
    on ``device`` reading from a disk of kind ``disk`` (reader.disk_of): what the config sets,
    else the default for the two (pieces only where the native reader may read: the others read
    whole blocks)."""
    virtio = torch.device(device).type == "cuda" and disk == "virtio"
    split = virtio and config.reader in ("native", "auto")
    depth = config.read_depth if config.read_depth is not None else VIRTIO_READ_DEPTH if virtio else None
    pieces = config.read_pieces if config.read_pieces is not None else VIRTIO_READ_PIECES if split else 1
    return depth, pieces


def cache_footprint(bundle: Bundle, quotas: dict[int, int], staging: int, spill: int = 0) -> int:
    """Bytes of the slots, the staging buffers and the ``spill`` rows (``lfu-bypass``: one set of
    each block size, shared by the layers)."""
    slots = sum(q * bundle.layouts[layer].block_bytes for layer, q in quotas.items())
    sizes = {lay.block_bytes for lay in bundle.layouts.values()}
    return slots + staging * max(sizes) + spill * sum(sizes)


def largest_uniform_quota(bundle: Bundle, budget: int, staging: int, spill: int = 0) -> int:
    per_slot = sum(lay.block_bytes for lay in bundle.layouts.values())
    return max((budget - cache_footprint(bundle, {}, staging, spill)) // per_slot, 0)


POOLS = ("host", "device", "mapped")
TIER_READS = ("in-place", "copy")


class ExpertCache:
    """A bundle's routed experts in bounded per-layer slot pools, as ``config`` sizes them.
    Keeps books and moves bytes; the expert step itself is ``engine/streaming.run_experts``."""

    def __init__(
        self,
        bundle: Bundle,
        config: CacheConfig,
        device: str | torch.device = "cpu",
    ) -> None:
        args = bundle.args
        device = torch.device(device)
        pool, staging, budget_bytes = config.pool, config.staging, config.budget
        if config.prefetch_ahead not in PREFETCH_AHEAD:  # before anything is allocated
            raise ConfigError(
                f"prefetch_ahead is 1 or 2 (layers a decode step reads ahead), got {config.prefetch_ahead!r}"
            )
        if pool is None:  # host memory is device memory on unified profiles: the GPU reads slots there
            pool = "host" if device.type == "cpu" else "mapped" if config.unified_memory else "device"
        if pool not in POOLS:
            raise QuotaError(f"slot pool {pool!r} is not one of {', '.join(POOLS)}")
        if (pool == "host") != (device.type == "cpu"):
            raise QuotaError(
                f"slot pool {pool!r} does not serve device {device}: host is for cpu, device and mapped for cuda"
            )
        quotas = config.quota_by_layer(args.moe_layers)
        if sorted(quotas) != sorted(args.moe_layers):
            raise QuotaError(
                f"quotas given for layers {sorted(quotas)}, the model's MoE layers are {list(args.moe_layers)}"
            )
        E = args.num_experts
        over = "/".join(str(q) for q in sorted(set(quotas.values())) if q > E)
        # stated, not silent: the start-up line carries it (engine/provenance.experts_text)
        self.adjustments = [f"quota {over} is more than a layer's {E} experts: {E} used"] if over else []
        quotas = {layer: min(q, args.num_experts) for layer, q in quotas.items()}
        staging = staging or 2 * args.num_experts_per_tok
        # construction refuses before allocating anything
        self.policy = config.policy or DEFAULT_POLICY
        if self.policy not in CACHE_POLICIES:
            raise QuotaError(f"expert cache policy {self.policy!r} is not one of {', '.join(CACHE_POLICIES)}")
        # the device slots' and a host tier's; lfu-bypass keeps top_k rows of each block size where a
        # miss left unheld is read and served from
        tiered = bool(config.host_quotas)
        self.slot_policy = slot_policy = held_policy(
            self.policy, tiered, all(q >= E for q in quotas.values())
        )
        if config.policy == "lfu-bypass" and tiered:  # asked for, not the default: said
            self.adjustments.append(
                "lfu-bypass: a host tier and the device slots before it hold every miss (lfu)"
            )
        self.spill_rows = args.num_experts_per_tok if slot_policy == "lfu-bypass" else 0
        spill = [0] * self.spill_rows  # each row's generation, shared by the layers (the rows are)
        slots = {
            layer: LayerSlots(layer, q, args.num_experts_per_tok, slot_policy, spill)
            for layer, q in quotas.items()
        }
        need = cache_footprint(bundle, quotas, staging, self.spill_rows)
        if budget_bytes is not None and need > budget_bytes:
            fits = largest_uniform_quota(bundle, budget_bytes, staging, self.spill_rows)
            hint = (
                f"a quota of {fits} per layer fits"
                if fits >= args.num_experts_per_tok
                else f"not even the minimum quota (top_k = {args.num_experts_per_tok}) fits"
            )
            spilled = f", {self.spill_rows} spill rows" if self.spill_rows else ""
            raise QuotaError(
                f"expert cache needs {need:,} bytes (quotas {_quota_text(quotas)}, {staging} staging buffers"
                f"{spilled}) but its budget is {budget_bytes:,} bytes: {hint}"
            )
        self.bundle = bundle
        self.device = device
        # each layer's expert file and whether its blocks carry checksums, found once (a lookup's hot path)
        self._files = {
            layer: (bundle.expert_path(layer), bundle.manifest.layer(layer).block_xxh3 is not None)
            for layer in quotas
        }
        # each block's checksum as the integer a native reader compares in C (None: unchecked)
        self._sums = {
            layer: [int(h, 16) for h in bundle.manifest.layer(layer).block_xxh3 or ()] or None
            for layer in quotas
        }
        self._fallbacks: dict[str, str] = {}
        if bundle.unchecked:
            self._fallbacks["unchecked_blocks"] = bundle.unchecked
        self.unchecked_reads = 0
        self.faults = {"checksum": 0, "io": 0}  # reads refused: a block failing twice; short read, I/O error
        if pool == "mapped":
            why = mapped_unsupported(device)
            if why:
                self._fallbacks["mapped_slots"] = f"{why}; slots live in device memory"
                pool = "device"
        self.pool_kind = pool
        self.slots = slots
        self.footprint_bytes = need
        self.io = {layer: LayerStats() for layer in quotas}  # warm reads, bytes, time
        block_sizes = {lay.block_bytes for lay in bundle.layouts.values()}
        disk = disk_of(bundle.expert_path(args.moe_layers[0])) if args.moe_layers else None
        depth, pieces = read_shape(config, device, disk and disk[1])
        if disk and (depth, pieces) != read_shape(config, device, None):  # the disk chose them: said
            self.adjustments.append(
                f"reads {depth} in flight in {pieces} pieces a block from {disk[0]}, a {disk[1]} disk (the "
                "fastest on the GPU machines' virtio disks; --read-depth / --read-pieces set them)"
            )
        self.readers = {
            bb: BlockReader(bb, staging, config.read_mode, depth, config.reader, pieces) for bb in block_sizes
        }
        # prefetched blocks wait in staging buffers; top_k of them stay for the lookups' own reads
        prefetch = config.prefetch
        if prefetch is None:  # the default: CPU slots (see docs/streaming.md, Prefetch, for CUDA's)
            prefetch = self.device.type == "cpu"
            if not prefetch:
                self.adjustments.append(
                    "prefetch off on CUDA by default (on an H200 with the native reader it was level or "
                    "10% slower where steps miss, and cost 43% where the slots held the steps' experts); "
                    "--prefetch turns it on"
                )
        self.prefetch_depth = max(staging - args.num_experts_per_tok, 0) if prefetch else 0
        if prefetch and not self.prefetch_depth:
            self.adjustments.append(
                f"prefetch off: {staging} staging buffers leave none beyond top_k {args.num_experts_per_tok}"
            )
        # layers a decode step reads ahead (the engine predicts that many); each layer may hold
        # an equal share of the prefetch buffers, so the layers' prefetches never compete for
        # them and the simulator replays each layer alone, exactly
        self.prefetch_ahead = min(config.prefetch_ahead, self.prefetch_depth) if self.prefetch_depth else 0
        if self.prefetch_depth and self.prefetch_ahead < config.prefetch_ahead:
            self.adjustments.append(
                f"prefetch {self.prefetch_ahead} layer ahead, not {config.prefetch_ahead}: "
                f"{self.prefetch_depth} prefetch buffer(s) cannot be shared by {config.prefetch_ahead} layers"
            )
        self.prefetch_share = self.prefetch_depth // self.prefetch_ahead if self.prefetch_ahead else 0
        self._staged: dict[int, dict[int, Future]] = {}  # layer -> expert -> staged read (prefetch)
        self._gates = {layer: PrefetchGate() for layer in quotas}  # how many a layer's prefetch may read
        self.copy_stream = None
        if pool == "device":
            # each read's staging buffer (page-locked) is copied to its slot on a side stream; the
            # read owns the buffer until its copy has completed
            self.copy_stream = torch.cuda.Stream(self.device)
            for r in self.readers.values():
                r.pin(self.device)  # a refusal is the reader's pageable_staging fallback
        self._host: list = []  # aligned mappings / pinned tensors backing host-side pools (kept alive)
        self.pools: dict[int, torch.Tensor] = {}  # what kernels read: [Q, block_bytes] uint8 on self.device
        self.host_slots: dict[int, torch.Tensor] = {}  # host and mapped pools: where reads land
        for layer, q in quotas.items():
            bb = bundle.layouts[layer].block_bytes
            if pool == "host":
                self.pools[layer] = self.host_slots[layer] = self._host_memory(q, bb)
            elif pool == "mapped":
                self.host_slots[layer] = self._host_memory(q, bb)
                self.pools[layer] = torch.as_tensor(_DeviceView(self.host_slots[layer]), device=device)
            else:
                self.pools[layer] = torch.empty(q, bb, dtype=torch.uint8, device=self.device)
        # lfu-bypass's spill rows, by block size: what the kernels read a passed miss from, as slots
        # Q.. of its layer (a FarTier's rows). Host memory (spill_host), where the read lands: on a
        # GPU page-locked and read in place, as the far tier is (on a discrete GPU its bytes cross
        # PCIe once either way, and the rows take pinned memory, not VRAM: the planner's
        # "spill_rows"); device memory only where the GPU cannot read host memory in place
        self.spill: dict[int, FarTier] = {}
        self.spill_host: dict[int, torch.Tensor] = {}
        for bb in block_sizes if self.spill_rows else ():
            B = self.spill_rows
            why = mapped_unsupported(device) if pool == "device" else None
            if why:  # stated: passed misses are then copied to the device, as slots' are
                self._fallbacks["spill_rows"] = f"{why}; spill rows in device memory, filled by copies"
                rows = torch.empty(B, bb, dtype=torch.uint8, device=self.device)
            else:
                rows = self.spill_host[bb] = self._host_memory(B, bb)
                if pool != "host":
                    rows = torch.as_tensor(_DeviceView(rows), device=device)
            self.spill[bb] = FarTier(rows)
        # the pinned host tier (discrete GPUs): a larger set under the same policy in page-locked host memory
        # between storage and the device slots, as the planner sizes it (host_quotas)
        self.tier: dict[int, LayerSlots] = {}
        self.tier_mem: dict[int, torch.Tensor] = {}
        self.host_tier_bytes = 0
        if config.host_quotas:
            self._make_tier(config.host_quotas, quotas)
        # a tier holding every expert of a layer is read in place: the far tier (``far``)
        self.far: dict[int, FarTier] = {}
        self._far_tables: dict[int, torch.Tensor] = {}
        self._far_counts: torch.Tensor | None = None
        self._far_scores: dict[int, list[float]] = {}  # decayed uses by expert, what the device set follows
        self._far_mode(config.tier_reads)
        self.cpu_split: dict[int, Any] = {}  # far layer -> its CpuExperts (engine/cpu_experts.attach)
        self.cpu_split_text = ""  # what attach chose, for the start-up line
        # layer -> slot -> its weights in the CPU kernels' layout (kernels/moe_cpu.py)
        self.packed: dict[int, dict] = {layer: {} for layer in quotas}
        self.scales = {}  # int4: fp32 [E, 2] global scales by expert; None for other formats
        # the same by slot ([Q, 2]; [Q + E, 2] with a far tier: its rows after the device slots'),
        # kept in step with every fill, for kernels
        self.slot_scales = {}
        for layer, q in quotas.items():
            s = bundle.global_scales(layer)
            self.scales[layer] = None if s is None else s.to(self.device)
            rows = q + (self.far[layer].rows.shape[0] if layer in self.far else self.spill_rows)
            self.slot_scales[layer] = (
                None if s is None else torch.ones(rows, 2, dtype=torch.float32, device=self.device)
            )

    def beyond(self, layer: int) -> FarTier | None:
        """What the expert kernels read slots Q.. of ``layer`` from: its far tier, or the spill
        rows its passed misses are read into (``lfu-bypass``); None where neither exists."""
        far = self.far.get(layer)
        if far is None and self.spill:
            return self.spill[self.bundle.layouts[layer].block_bytes]
        return far

    def _far_mode(self, tier_reads: str | None) -> None:
        """Each layer whose pinned host tier holds every expert becomes a far tier the GPU reads in
        place over PCIe (``tier_reads`` in-place, or None where the GPU reads mapped host memory):
        the device slots hold some experts, every other is read from pinned memory by the same
        kernels, so all are reachable from one slot table and a decode step stays one graph."""
        if tier_reads not in (None, *TIER_READS):
            raise QuotaError(f"tier_reads {tier_reads!r} is not one of {', '.join(TIER_READS)}")
        E = self.bundle.args.num_experts
        full = [layer for layer, t in self.tier.items() if t.quota >= E]
        if tier_reads == "copy" or not full:
            return
        why = mapped_unsupported(self.device)
        if why:
            if tier_reads == "in-place":
                raise QuotaError(f"tier_reads in-place: {why}")
            self._fallbacks["tier_reads"] = f"{why}; the host tier's experts are copied into device slots"
            return
        self._far_counts = torch.zeros(len(full), dtype=torch.int64, device=self.device)
        self._far_uses = torch.zeros(len(full), E, dtype=torch.int32, device=self.device)
        for k, layer in enumerate(full):
            rows = torch.as_tensor(_DeviceView(self.tier_mem[layer]), device=self.device)
            self.far[layer] = FarTier(rows, self._far_counts[k : k + 1], self._far_uses[k])
            self._far_scores[layer] = [0.0] * E

    def _make_tier(self, host_quota: int | Mapping[int, int], quotas: dict[int, int]) -> None:
        args = self.bundle.args
        hq = dict(host_quota) if isinstance(host_quota, Mapping) else {layer: host_quota for layer in quotas}
        if sorted(hq) != sorted(quotas):
            raise QuotaError(
                f"host tier quotas given for layers {sorted(hq)}, the MoE layers are {sorted(quotas)}"
            )
        if self.pool_kind == "mapped":
            raise QuotaError("a host tier is for device slot pools: mapped slots already live in host memory")
        for layer, q in hq.items():
            q = min(q, args.num_experts)
            if q < quotas[layer]:
                raise QuotaError(
                    f"layer {layer}: host tier quota {q} is below the device quota {quotas[layer]}; "
                    "the tier holds every device slot's expert and more"
                )
            bb = self.bundle.layouts[layer].block_bytes
            self.tier[layer] = LayerSlots(layer, q, args.num_experts_per_tok, self.slot_policy)
            self.tier_mem[layer] = self._host_memory(q, bb)
            self.host_tier_bytes += q * bb

    def _host_memory(self, q: int, bb: int) -> torch.Tensor:
        """q page-aligned blocks of host memory (O_DIRECT reads land in them), kept alive by the
        cache: page-locked with CUDA (copies to the device run async; a mapped pool's GPU reads
        them in place, its pinned host pointer being a valid device pointer under unified virtual
        addressing), a plain anonymous mapping on the CPU."""
        if self.device.type == "cuda":
            mem = _pinned(q * bb)
        else:
            buf = aligned_buffer(q * bb)
            self._host.append(buf)
            mem = torch.frombuffer(buf, dtype=torch.uint8, count=q * bb)
        self._host.append(mem)
        return mem.view(q, bb)

    @property
    def quotas(self) -> dict[int, int]:
        return {layer: s.quota for layer, s in self.slots.items()}

    # ---- data movement ------------------------------------------------------------------

    def _fill(self, layer: int, fills: list[Fill], then: Callable[[], object] | None = None) -> None:
        """Bring every miss of one layer into its slot: from the host tier when there is one,
        else read from storage; all are in flight before the first is awaited. Prefetched reads of
        the layer are claimed or dropped here, on every lookup. ``then`` runs once this layer's
        reads are queued, before they are awaited (the next layer's prefetch: its reads queue
        behind these and keep the disk busy while these land and the layer computes)."""
        staged = self._claim(layer, fills)
        if not fills:
            if then is not None:
                then()
            return
        for f in fills:  # the slot's CPU-kernel layout is of its old expert: repacked on next use
            self.packed[layer].pop(f.slot, None)
        pool = self.pools[layer]
        stream = self.copy_stream
        Q, bb = self.slots[layer].quota, self.bundle.layouts[layer].block_bytes
        in_place = self.pool_kind == "mapped" or (
            self.device.type == "cuda" and bb in self.spill_host and any(f.slot >= Q for f in fills)
        )
        if in_place:
            # the GPU reads these slots (or spill rows) in place: let every queued kernel finish
            # before refilling (a decode step's lookup waited for its router already: no wait left)
            torch.cuda.current_stream(self.device).synchronize()
        elif stream is not None:
            # a refill is ordered after every kernel already queued that may read the slot's old expert
            stream.wait_stream(torch.cuda.current_stream(self.device))
        scales = self.slot_scales[layer]

        def queued() -> None:  # once the reads are in flight: work that need not wait for them
            if scales is not None:  # queued after every kernel that may read the slots' old scales
                # slots and experts in one host->device copy (a pageable copy waits for the host)
                idx, src = torch.tensor([[f.slot for f in fills], [f.expert for f in fills]]).to(self.device)
                scales.index_copy_(0, idx, self.scales[layer].index_select(0, src))
            if then is not None:
                then()

        if layer in self.tier:
            queued()
            self._copy_from_tier(layer, fills)
            if layer in self._far_tables:  # the moved experts' entries, after their copies completed
                self._far_tables[layer].copy_(self._far_table(layer))
            return
        host = self.host_slots.get(layer)
        spill = self.spill_host.get(bb)

        def target(slot: int) -> Target:  # where a slot's block goes (from Q on: a spill row)
            if slot >= Q and spill is not None:  # host memory: read into the row itself on a GPU
                return Target("direct" if self.device.type == "cuda" else "host", spill[slot - Q])
            if self.pool_kind == "mapped":  # read into the slot itself
                return Target("direct", host[slot])
            if stream is None:
                return Target("host", host[slot])
            # an async copy: the staging buffer's fence, its next read waits for it, nobody else
            return Target("device", pool[slot] if slot < Q else self.spill[bb].rows[slot - Q], stream)

        try:
            self._read(layer, self.slots[layer], fills, target, staged=staged, then=queued)
        finally:  # every copy is queued (each read's before its future completed), a failed lookup's too
            if stream is not None:
                torch.cuda.current_stream(self.device).wait_stream(stream)

    def _read(
        self,
        layer: int,
        table: LayerSlots,
        fills: list[Fill],
        target: Callable[[int], Target],
        staged: dict[int, Future] | None = None,
        then: Callable[[], object] | None = None,
    ) -> None:
        """Read ``fills`` from storage to ``target(slot)`` (:class:`Target`: into host memory
        directly, or through a staging buffer copied to the slot); a fill whose expert is in
        ``staged`` (a prefetch of it, claimed) is placed from that read's buffer instead. A
        failed read's slot is abandoned in ``table`` (read again next time); the first error is
        re-raised once all settled. ``then`` runs once every read is queued (see ``_fill``)."""
        bb = self.bundle.layouts[layer].block_bytes
        reader = self.readers[bb]
        path, checked = self._files[layer]
        sums = self._sums[layer]
        n = self.bundle.args.num_experts
        staged = staged or {}

        def submit(f: Fill):
            if not checked:
                return reader.fetch(path, f.expert, n, target(f.slot))
            check = partial(self.bundle.check_block, layer, f.expert)
            return reader.fetch(path, f.expert, n, target(f.slot), check, sums[f.expert])

        t0 = time.perf_counter()
        # every read in flight before the first is awaited; prefetched blocks are placed first,
        # handing their staging buffers back to the reads still queued
        futures = [(f, submit(f)) for f in fills if f.expert not in staged]
        claimed = [(f, staged[f.expert]) for f in fills if f.expert in staged]
        if then is not None:
            then()
        error, done = None, 0
        for f, fut in claimed + futures:
            try:
                got = fut.result()
                if not isinstance(got, int):  # a claimed prefetch: its buffer to the slot
                    got.place(target(f.slot))
                done += 1
            except Exception as exc:  # noqa: BLE001 - every failed fill is abandoned, then the first re-raised
                table.abandon(f)
                if isinstance(exc, StorageError):
                    self.faults["checksum" if isinstance(exc, ChecksumError) else "io"] += 1
                error = error or exc
        st = self.io[layer]
        st.read_seconds += time.perf_counter() - t0
        st.bytes_read += bb * done
        st.prefetch_useful += len(claimed)
        st.prefetch_bytes += bb * len(claimed)
        if not checked:
            self.unchecked_reads += done
        if error is not None:
            raise error

    # ---- prefetch -----------------------------------------------------------------------

    def prefetch(self, layer: int, experts: Iterable[int], ahead: int = 1) -> int:
        """Start reading those of ``experts`` that ``layer`` does not hold, before its lookup
        asks (the next layer's predicted experts; a prefill's next batch): into staging buffers,
        not slots. The layer's next fill places each one it needs from there and drops the rest
        (wasted). Slots and their books are untouched until that lookup, so no slot a step holds
        a reference to is refilled, and hits and misses count as without prefetch. At most
        ``prefetch_share`` prefetches of one layer are outstanding (issued, not yet claimed or
        dropped): ``prefetch_depth`` over the ``prefetch_ahead`` layers a step reads ahead, so
        the layers never compete for buffers; counted here rather than by the reader's busy
        buffers so that the simulator replays the count exactly. A layer's guesses may come in
        two calls (``ahead`` 2, two layers before its lookup, then refined one layer before it):
        the first may take half the share (rounded up), the second adds what it lacks. The
        other ``top_k`` buffers stay for the lookups' own reads (one may wait for a dropped read
        still landing, never for a claim). Returns how many reads were issued (0 with prefetch
        off). How many of the guesses are read follows how the layer's recent ones fared
        (:class:`~edgerun.cache.policy.PrefetchGate`)."""
        if not self.prefetch_depth or layer in self.tier:
            return 0
        bb = self.bundle.layouts[layer].block_bytes
        reader = self.readers[bb]
        held, staged = self.slots[layer].slot_of, self._staged.setdefault(layer, {})
        # (the total bound is the buffers' guard: a lookup's own reads always find top_k free; the
        # shares never reach it while the engine reads prefetch_ahead layers ahead)
        total = self.prefetch_depth - sum(map(len, self._staged.values()))
        share = (self.prefetch_share + 1) // 2 if ahead > 1 else self.prefetch_share
        room = self._gates[layer].limit(max(min(share - len(staged), total), 0))
        todo = [e for e in dict.fromkeys(experts) if e not in held and e not in staged][:room]
        (path, checked), n = self._files[layer], self.bundle.args.num_experts
        sums = self._sums[layer]
        for e in todo:
            if checked:
                staged[e] = reader.stage(path, e, n, partial(self.bundle.check_block, layer, e), sums[e])
            else:
                staged[e] = reader.stage(path, e, n)
        self.io[layer].prefetch_issued += len(todo)
        return len(todo)

    def _claim(self, layer: int, fills: list[Fill]) -> dict[int, Future]:
        """The layer's prefetched reads its ``fills`` need; the rest are dropped as wasted."""
        staged = self._staged.pop(layer, None)
        if not staged:
            return {}
        need = {f.expert for f in fills}
        dropped = [e for e in staged if e not in need]
        for e in dropped:
            self._drop(layer, staged.pop(e))
        self._gates[layer].record(len(staged), len(dropped))
        return staged

    def _drop(self, layer: int, future: Future) -> None:
        st = self.io[layer]
        st.prefetch_wasted += 1
        if not self.readers[self.bundle.layouts[layer].block_bytes].drop(future):
            st.prefetch_bytes += self.bundle.layouts[layer].block_bytes  # read (or reading): it cost

    def _tier_get(self, layer: int, expert_ids: list[int], count: bool = True) -> None:
        """The host tier sees every lookup (so it holds the device slots' experts and more, as the
        same policy at a larger quota does) and reads its own misses from storage into pinned
        memory; a step's experts are in it before the device slots copy them."""
        _, fills = self.tier[layer].assign(expert_ids, count=count)
        mem = self.tier_mem[layer]
        self._read(layer, self.tier[layer], fills, lambda slot: Target("direct", mem[slot]))

    def _copy_from_tier(self, layer: int, fills: list[Fill]) -> None:
        pool, mem, table = self.pools[layer], self.tier_mem[layer], self.tier[layer].slot_of
        stream = self.copy_stream
        self.io[layer].tier_copies += len(fills)
        if stream is None:
            for f in fills:
                pool[f.slot].copy_(mem[table[f.expert]])
            return
        with torch.cuda.stream(stream):
            for f in fills:
                pool[f.slot].copy_(mem[table[f.expert]], non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()  # a host slot is refilled only after its copies completed

    def get_many(
        self, layer: int, expert_ids: list[int], then: Callable[[], object] | None = None
    ) -> list[SlotRef]:
        """References to one step's experts (router order, deduplicated), reading the misses.
        ``then`` runs once the misses' reads are queued, before they are awaited (``_fill``)."""
        if layer in self.tier:
            self._tier_get(layer, expert_ids)
        refs, fills = self.slots[layer].assign(expert_ids)
        self._fill(layer, fills, then)
        return refs

    def check(self, layer: int, refs, spill: bool = True) -> None:
        """Refuse (:class:`StaleSlotError`) any reference whose slot was refilled since its lookup
        (``spill`` False: its spill rows' references are not checked)."""
        table = self.slots[layer]
        Q = table.quota
        for ref in refs:
            if spill or ref.slot < Q:
                table.check(ref)

    def slot_table(self, layer: int) -> torch.Tensor | None:
        """expert -> slot (int64 [E] on the device) when every expert of ``layer`` is held, so a
        step can find its slots on the device without a host round trip; else None. Valid until
        the next eviction, which cannot happen while every expert is held. With a far tier every
        expert is reachable: a device slot, or slot Q + its row in the tier; that table is one
        tensor, updated in place when a lookup moves experts into device slots."""
        if layer in self.far:
            if layer not in self._far_tables:
                self._far_tables[layer] = self._far_table(layer).to(self.device)
            return self._far_tables[layer]
        table = self.slots[layer].slot_of
        if len(table) < self.bundle.args.num_experts:
            return None
        return torch.tensor([table[e] for e in range(self.bundle.args.num_experts)], device=self.device)

    def rebalance_far(self, decay: float = 0.5, max_swaps: int | None = None) -> int:
        """Move each far layer's device slots toward its most used experts: the decode kernel's
        per-expert counts since the last call (one device sync for every layer) are added to
        decayed scores, and up to ``max_swaps`` (default Q/8) of the most used experts the slots
        lack replace the least used they hold (``far_swaps``), copied from the pinned tier on the
        copy stream after every queued kernel, the slot table updated in place before the next
        launch. Call between decode steps. Returns the experts moved (counted as tier copies)."""
        if not self.far:
            return 0
        used = self._far_uses.tolist()
        self._far_uses.zero_()
        moved = 0
        for layer, row in zip(self.far, used, strict=True):
            scores = self._far_scores[layer]
            for e, n in enumerate(row):
                scores[e] = scores[e] * decay + n
            table = self.slots[layer]
            swaps = far_swaps(scores, table.slot_of, max_swaps or max(table.quota // 8, 1))
            if not swaps:
                continue
            for victim, _ in swaps:
                table.release(victim)
            _, fills = table.assign([p for _, p in swaps], count=False)
            self._fill(layer, fills)
            moved += len(fills)
        return moved

    def _far_table(self, layer: int) -> torch.Tensor:
        Q, tier = self.slots[layer].quota, self.tier[layer].slot_of
        table = [Q + tier[e] for e in range(self.bundle.args.num_experts)]
        for e, s in self.slots[layer].slot_of.items():
            table[e] = s
        return torch.tensor(table, dtype=torch.int64)

    def pack_held(self) -> int:
        """Repack now, for the CPU expert kernels, every slot of each layer that holds all its
        experts (it never refills them), instead of on each expert's first use: the cost moves
        from the first request's prefill to loading. Returns the slots packed."""
        from edgerun.kernels.moe_cpu import pack_slots
        from edgerun.progress import iterate

        E = self.bundle.args.num_experts
        full = [layer for layer, table in self.slots.items() if len(table.slot_of) >= E]
        n = 0
        for layer in iterate(full, len(full), "repack experts", "layer"):
            packed = self.packed[layer]
            before = len(packed)
            slots = sorted(self.slots[layer].slot_of.values())
            pack_slots(self.bundle.layouts[layer], self.pools[layer], self.slot_scales[layer], slots, packed)
            n += len(packed) - before
        return n

    def count_window(self, layer: int, distinct: int) -> None:
        """A speculative verify window ran through ``layer``, needing ``distinct`` experts."""
        st = self.io[layer]
        st.verify_windows += 1
        st.window_experts += distinct

    def packed_bytes(self) -> int:
        """What the CPU expert kernels' packed copies take once every slot is in use: beside
        each int4 slot, its repacked layout (``kernels/cpu_layout.py``; the planner counts the
        same on a device without CUDA)."""
        from edgerun.kernels.cpu_layout import packed_bytes

        return sum(q * packed_bytes(self.bundle.layouts[layer]) for layer, q in self.quotas.items())

    def count_cpu_pairs(self, layer: int, n: int) -> None:
        """``n`` pairs of a far layer's step were computed on the CPU (counted among its hits)."""
        self.io[layer].cpu_pairs += n

    def count_hits(self, layer: int, n: int) -> None:
        """Hits a step served on the device through :meth:`slot_table` (no host bookkeeping ran)."""
        self.slots[layer].counters.hits += n

    def hold_complete_layers(self) -> None:
        """Read in every expert of each layer whose quota holds them all: such a layer never
        misses or evicts, so its slot table is valid from the start (one graph per decode step)."""
        from edgerun.progress import iterate

        E = self.bundle.args.num_experts
        full = [layer for layer, table in self.slots.items() if table.quota >= E and len(table.slot_of) < E]
        far = [layer for layer in self.far if len(self.tier[layer].slot_of) < E]
        for layer in iterate(full + far, len(full + far), "read experts", "layer"):
            if layer in self.far:
                self._hold_far(layer)
            else:
                self._preload(layer, list(range(E)))

    def _hold_far(self, layer: int) -> None:
        """Read every expert of a far layer into its pinned tier, with each one's global scales
        at its far slot, and the device slots' first experts (ids 0..Q-1 until a warm set or the
        lookups choose others) copied in."""
        E, Q = self.bundle.args.num_experts, self.slots[layer].quota
        reads, bb = self.io[layer].bytes_read, self.bundle.layouts[layer].block_bytes
        self._tier_get(layer, list(range(E)), count=False)
        scales = self.slot_scales[layer]
        if scales is not None:
            tier = self.tier[layer].slot_of
            rows = torch.tensor([Q + tier[e] for e in range(E)], device=self.device)
            scales.index_copy_(0, rows, self.scales[layer])
        _, fills = self.slots[layer].assign(list(range(Q)), count=False)
        self._fill(layer, fills)
        self.io[layer].warm_reads += (self.io[layer].bytes_read - reads) // bb

    def warm(self, frequencies: dict[int, list[float] | dict[int, float]]) -> None:
        """Preload each layer's most used experts (up to its quota); they stay evictable."""
        from edgerun.progress import iterate

        for layer, freq in iterate(frequencies.items(), len(frequencies), "warm experts", "layer"):
            if layer not in self.slots:
                raise QuotaError(f"warm set names layer {layer}, which is not a MoE layer of this model")
            counts = dict(enumerate(freq)) if isinstance(freq, list) else {int(k): v for k, v in freq.items()}
            ranked = sorted(counts, key=lambda e: (-counts[e], e))
            self._preload(layer, ranked[::-1])  # least used first: the most used ends most recent

    def _preload(self, layer: int, experts: list[int]) -> None:
        """Bring the last ``quota`` of ``experts`` (the last most recent) into the slots (and the
        last tier-quota into the host tier); counted as warm reads, not misses."""
        reads, bb = self.io[layer].bytes_read, self.bundle.layouts[layer].block_bytes
        if layer in self.tier:
            self._tier_get(layer, experts[-self.tier[layer].quota :], count=False)
        _, fills = self.slots[layer].assign(experts[-self.slots[layer].quota :], count=False)
        self._fill(layer, fills)
        self.io[layer].warm_reads += (self.io[layer].bytes_read - reads) // bb  # storage reads

    # ---- reporting ----------------------------------------------------------------------

    def far_reads(self) -> dict[int, int]:
        """(token, expert) pairs each far layer's kernels served from its pinned tier (one device
        sync for all layers); empty without a far tier."""
        if self._far_counts is None:
            return {}
        return dict(zip(self.far, self._far_counts.tolist(), strict=True))

    def layer_stats(self, layer: int, far: dict[int, int] | None = None) -> LayerStats:
        """One layer's counters. A far layer's slot-table steps count every pair as a hit; the
        pairs read from the far tier are taken out of the hits and given as ``far_reads``, those
        computed on the CPU as ``cpu_pairs``."""
        c = self.slots[layer].counters
        stats = replace(self.io[layer], hits=c.hits, misses=c.misses, evictions=c.evictions, passed=c.passed)
        if layer in self.far:
            stats.far_reads = (far if far is not None else self.far_reads())[layer]
            stats.hits -= stats.far_reads + stats.cpu_pairs
        return stats

    def totals(self) -> LayerStats:
        t = LayerStats()
        far = self.far_reads()
        for s in (self.layer_stats(layer, far) for layer in self.slots):
            for f in fields(LayerStats):
                setattr(t, f.name, getattr(t, f.name) + getattr(s, f.name))
        return t

    def fallbacks(self) -> dict[str, str]:
        out: dict[str, str] = dict(self._fallbacks)
        for r in self.readers.values():
            out.update(r.stats.fallbacks)
        return out

    def reads_by_backend(self) -> dict[str, int]:
        """Blocks read from storage by each system call in use (preadv, io_uring)."""
        out: dict[str, int] = {}
        for r in self.readers.values():
            out[r.backend] = out.get(r.backend, 0) + r.stats.reads
        return out

    def disk_time(self) -> dict[str, float]:
        """Over every reader: ``busy``, the seconds with an expert read in flight; ``requests``,
        the reads in flight integrated over time (a piece each where blocks are read in pieces).
        Their ratio is the disk's mean queue while busy: what its rate depends on."""
        stats = [r.stats for r in self.readers.values()]
        return {
            "busy": sum(s.wall_seconds for s in stats),
            "requests": sum(s.depth_seconds for s in stats),
        }

    def fallback_reads(self) -> dict[str, int]:
        """Reads served under each read fallback (buffered reads, pageable staging)."""
        out: dict[str, int] = {"unchecked_blocks": self.unchecked_reads} if self.unchecked_reads else {}
        for r in self.readers.values():
            for kind, n in r.stats.fallback_reads.items():
                out[kind] = out.get(kind, 0) + n
        return out

    def read_faults(self) -> dict[str, int]:
        """Blocks read again after failing their checksum (``reread``), and reads refused: a block
        that failed twice (``checksum``), a short read or I/O error (``io``)."""
        rs = [r.stats for r in self.readers.values()]
        wasted = sum(s.wasted_faults for s in rs)  # prefetched, failed, not asked for: no token used them
        return {
            "reread": sum(s.rereads for s in rs),
            **self.faults,
            **({"prefetch": wasted} if wasted else {}),
        }

    def close(self) -> None:
        for layer in list(self._staged):
            self._claim(layer, [])
        for r in self.readers.values():
            r.close()
        self.readers.clear()
        self.pools.clear()
        self.host_slots.clear()
        self.tier_mem.clear()
        self.far.clear()
        self._far_tables.clear()
        self._host.clear()


def far_swaps(
    scores: list[float], held: Iterable[int], max_swaps: int, margin: float = 1.25
) -> list[tuple[int, int]]:
    """(victim, promoted) pairs moving a far layer's device slots toward its most used experts:
    the highest-scored experts not ``held`` replace the lowest-scored held ones, best against
    worst, while a promoted expert's score is above ``margin`` times its victim's plus one use
    (so equal or noisy scores move nothing), at most ``max_swaps``. Ties go to the lower id."""
    held = set(held)
    outside = sorted((e for e in range(len(scores)) if e not in held), key=lambda e: (-scores[e], e))
    inside = sorted(held, key=lambda e: (scores[e], e))
    swaps = []
    for promoted, victim in zip(outside, inside):
        if len(swaps) >= max_swaps or scores[promoted] <= margin * scores[victim] + 1:
            break
        swaps.append((victim, promoted))
    return swaps


def _pinned(nbytes: int) -> torch.Tensor:
    """Page-locked, page-aligned host bytes (O_DIRECT reads land in them)."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=True)
    skew = (-raw.data_ptr()) % ALIGN
    return raw[skew : skew + nbytes]


def mapped_unsupported(device: torch.device) -> str | None:
    """None if the GPU reads page-locked host memory through its host address (unified virtual
    addressing), checked by a round trip; else why not."""
    try:
        host = _pinned(ALIGN)
        host.copy_(torch.arange(ALIGN, dtype=torch.int64).remainder(251).to(torch.uint8))
        seen = torch.as_tensor(_DeviceView(host), device=device).clone().cpu()
        if not torch.equal(seen, host):
            return f"{device} read other bytes than the host wrote through a mapped pointer"
    except Exception as exc:  # noqa: BLE001 - any failure means: not usable, and why
        return f"{device} cannot read mapped host memory ({type(exc).__name__}: {exc})"
    return None


class _DeviceView:
    """A pinned host tensor presented to torch as device memory (``__cuda_array_interface__``);
    holds the tensor so the memory outlives every view."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "typestr": "|u1",
            "data": (host.data_ptr(), False),
            "strides": None,
            "version": 3,
        }


def _quota_text(quotas: dict[int, int]) -> str:
    values = set(quotas.values())
    return f"{values.pop()} x {len(quotas)} layers" if len(values) == 1 else str(quotas)
