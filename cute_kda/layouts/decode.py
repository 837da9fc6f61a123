"""Thread map of the decode kernel (:mod:`cute_kda.kernels.decode`): which state elements, key channels and
value rows each thread holds, and the 16-byte vectors it moves between the state pool and its registers.

A CTA owns one (sequence, value head, V-band) of ``128 / vsplit`` value rows. Its threads form groups of 8
lanes; a group holds ``rows`` value rows of the band and splits the 128 key channels 16 a lane, so the two
dot products of a row over K (``sᵥ·k`` and ``sᵥ·q``) are 16 fused multiply-adds per lane and a 3-step
butterfly. The state registers of a thread are ``s[row, e]`` (``rows × 16`` fp32), ``e`` the lane's channel
slot; channel slot ``e`` of lane ``j`` is key channel :meth:`DecodeThreadMap.channel` — the order
:func:`cute_kda.reference.decode.channel_order` fixes for the mirror (the tests compare the two).

- V-first (``[V, K]``, a row contiguous in k): a group holds 4 rows; per row, lane ``j`` moves the ``i``-th
  16-byte vector of every 8-vector stretch, so the 8 lanes of a row read 128 contiguous bytes per load.
- K-first (``[K, V]``, a k row contiguous in v): a group holds the ``E`` value columns of one 16-byte vector
  (``E`` = 4 fp32 or 8 bf16); lane ``j`` holds the k rows ``16 j .. 16 j + 15``, one vector each.
- Paired (``halves`` 2, V-first): a group holds two blocks of 4 rows, 8 consecutive rows; the kernel runs the
  token on one block at a time (:meth:`DecodeThreadMap.block_vectors`), so the second block waits as loaded.
- Split token preparation (either layout): a lane's channels depend on its lane alone, so the 4 groups of a warp
  hold the same channels; each group prepares one token's q̂, k̂, decay and β (:meth:`DecodeThreadMap.own_token`)
  and every lane takes token ``t``'s from lane :meth:`DecodeThreadMap.token_source` of the warp.

Everything here is plain integers (lane, group, band may be DSL integers: the kernel evaluates the same
expressions at trace time).
"""

from __future__ import annotations

from dataclasses import dataclass

DIM = 128  # K = V
LANES = 8  # lanes sharing one value row's dot products
WARP_GROUPS = 32 // LANES  # thread groups of a warp (split token preparation: at most one token each)
CHANNELS = DIM // LANES  # key channels per lane
VECTOR_BYTES = 16
DECODE_VSPLITS = (1, 2, 4, 8)
STATE_BYTES = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class StateVector:
    """One 16-byte vector of a thread's state: its element offset from :meth:`DecodeThreadMap.state_base`
    inside the head's ``[128, 128]`` block, and the register ``(row, channel slot)`` of each element."""

    offset: int
    registers: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class ChannelRun:
    """Consecutive key channels of a lane: channel slots ``first .. first + length − 1`` are the channels
    ``lane_channel_base + offset ..`` (q, k, a per-channel gate, dt_bias are read in these runs)."""

    first: int
    length: int
    offset: int


@dataclass(frozen=True)
class DecodeThreadMap:
    """The map for one state layout (``"vk"`` V-first, ``"kv"`` K-first), state dtype (``"fp32"``,
    ``"bf16"``), V-split (value rows per CTA ``128 / vsplit``) and blocks of rows a group (``halves``: 1, or 2
    for a V-first state)."""

    state_layout: str
    state_dtype: str
    vsplit: int
    halves: int = 1

    def __post_init__(self) -> None:
        if self.halves not in (1, 2) or (self.halves == 2 and self.state_layout != "vk"):
            raise ValueError(f"halves must be 1, or 2 for a V-first state, got {self.halves} ({self.state_layout})")
        if self.state_layout not in ("vk", "kv"):
            raise ValueError(f"state_layout must be 'vk' or 'kv', got {self.state_layout!r}")
        if self.state_dtype not in STATE_BYTES:
            raise ValueError(f"state_dtype must be one of {tuple(STATE_BYTES)}, got {self.state_dtype!r}")
        if self.vsplit not in DECODE_VSPLITS or self.threads < 32:
            raise ValueError(f"vsplit {self.vsplit} is not supported for a {self.state_dtype} {self.state_layout} "
                             f"state (one of {self.vsplits(self.state_layout, self.state_dtype, self.halves)})")

    @staticmethod
    def vsplits(state_layout: str, state_dtype: str, halves: int = 1) -> tuple[int, ...]:
        """The V-splits that leave a CTA at least one warp."""
        rows = 4 * halves if state_layout == "vk" else VECTOR_BYTES // STATE_BYTES[state_dtype]
        return tuple(v for v in DECODE_VSPLITS if DIM // v // rows * LANES >= 32)

    @property
    def vector(self) -> int:
        """State elements per 16-byte vector."""
        return VECTOR_BYTES // STATE_BYTES[self.state_dtype]

    @property
    def rows(self) -> int:
        """Value rows per thread group (and per thread)."""
        return 4 * self.halves if self.state_layout == "vk" else self.vector

    @property
    def block_rows(self) -> int:
        """Value rows a token's update runs on at once (a block: all the rows, or half of them when paired)."""
        return self.rows // self.halves

    @property
    def band(self) -> int:
        """Value rows per CTA."""
        return DIM // self.vsplit

    @property
    def threads(self) -> int:
        return self.band // self.rows * LANES

    def channel(self, lane: int, e: int) -> int:
        """Key channel of channel slot ``e`` of ``lane``."""
        if self.state_layout == "kv":
            return lane * CHANNELS + e
        return (e // self.vector) * (LANES * self.vector) + lane * self.vector + e % self.vector

    def lane_channel_base(self, lane):
        """First key channel of ``lane`` (the runs are offsets from it)."""
        return lane * (CHANNELS if self.state_layout == "kv" else self.vector)

    def channel_runs(self) -> tuple[ChannelRun, ...]:
        if self.state_layout == "kv":
            return (ChannelRun(0, CHANNELS, 0),)
        e = self.vector
        return tuple(ChannelRun(i * e, e, i * LANES * e) for i in range(CHANNELS // e))

    @staticmethod
    def own_token(tidx, tokens: int):
        """The token whose operands thread ``tidx``'s group prepares (split preparation): group ``g`` of its warp
        takes token ``g mod tokens`` (``tokens`` ≤ :data:`WARP_GROUPS`)."""
        return tidx // LANES % WARP_GROUPS % tokens

    @staticmethod
    def token_source(lane, t: int):
        """The lane of the warp whose group prepared token ``t`` for key-channel lane ``lane`` (split
        preparation): lane ``lane`` of group ``t``."""
        return lane + LANES * t

    def first_value(self, band, group):
        """First value row (V-first) or column (K-first) of a group's ``rows`` consecutive ones."""
        return band * self.band + group * self.rows

    def state_base(self, lane, first_value):
        """Element offset of a thread's first state element in the head's ``[128, 128]`` block."""
        if self.state_layout == "kv":
            return lane * CHANNELS * DIM + first_value
        return first_value * DIM + lane * self.vector

    def state_vectors(self) -> tuple[StateVector, ...]:
        e = self.vector
        if self.state_layout == "kv":
            return tuple(StateVector(slot * DIM, tuple((c, slot) for c in range(e))) for slot in range(CHANNELS))
        return tuple(
            StateVector(row * DIM + i * LANES * e, tuple((row, i * e + c) for c in range(e)))
            for row in range(self.rows) for i in range(CHANNELS // e)
        )

    def block_first_row(self, half: int) -> int:
        """The first of block ``half``'s rows, counted from the group's first value row: the block's state, v and
        outputs are the group's rows ``block_first_row(half) ..`` (its registers number them from 0)."""
        return half * self.block_rows

    def block_vectors(self, half: int) -> tuple[StateVector, ...]:
        """The vectors of block ``half`` (rows :meth:`block_first_row` ``..``), their registers numbered from the
        block's first row."""
        first = self.block_first_row(half)
        return tuple(StateVector(vector.offset, tuple((row - first, e) for row, e in vector.registers))
                     for vector in self.state_vectors() if first <= vector.registers[0][0] < first + self.block_rows)
