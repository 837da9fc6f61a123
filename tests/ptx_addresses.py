"""The shared-memory addresses a straight-line PTX kernel gives its ldmatrix / stmatrix, lane by lane, on the CPU.

A probe kernel (one warp, no loops, no branches) computes its addresses from ``%laneid``, its scalar parameters
and the dynamic shared-memory base; :func:`matrix_addresses` runs that integer arithmetic for one lane and
returns the address operand of every ``ldmatrix`` / ``stmatrix`` in program order, in bytes from the base
(taken as 0: the base is 1024-byte aligned). It knows the integer instructions the DSL emits for address
arithmetic and raises on anything else, so a probe that grows other instructions fails loudly.
"""

from __future__ import annotations

import re

_MASK = 0xFFFFFFFF
_INSTRUCTION = re.compile(r"(@!?%p\d+\s+)?([a-z][\w.:]*)\s+(.*)")


_BINARY = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b, "and": lambda a, b: a & b,
    "or": lambda a, b: a | b, "xor": lambda a, b: a ^ b,
    "shl": lambda a, b: a << min(b, 64),  # PTX clamps the shift; the caller's mask drops what overflows
}


def _signed(x: int) -> int:
    x &= _MASK
    return x - (1 << 32) if x >> 31 else x


def matrix_addresses(ptx: str, lane: int, params: list[int]) -> list[int]:
    """Addresses of the ldmatrix / stmatrix instructions of the kernel in ``ptx`` for ``lane``.

    ``params``: the kernel's parameters in order (a tensor parameter's value is never used for an address).
    """
    body = ptx[ptx.index(".entry"):]
    regs: dict[str, int | bool] = {}
    addresses: list[int] = []

    def value(token: str) -> int:
        token = token.strip()
        if token.startswith("%"):
            return int(regs[token])
        if token.startswith("__dynamic_shmem"):
            return 0
        return int(token, 0) & _MASK

    for line in body.splitlines():
        line = line.strip().rstrip(";")
        if not line or line.startswith(("//", ".", "{", "}", "ret")):
            continue
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        guard, op, args = match.groups()
        if guard:
            taken = bool(regs[guard.strip().lstrip("@!")])
            if taken == guard.strip().startswith("@!"):
                continue
        base = op.split(".")[0]
        if base in ("ldmatrix", "stmatrix"):
            operand = re.search(r"\[([^\]]+)\]", args).group(1)
            register, _, offset = operand.partition("+")
            addresses.append((value(register) + (int(offset) if offset else 0)) & _MASK)
            continue
        if base in ("st", "ld") and "param" not in op:
            continue  # the probe's own stores of the fragments
        ops = [x.strip() for x in args.split(",")]
        dest = ops[0]
        if base == "ld":
            regs[dest] = params[int(re.search(r"param_(\d+)", args).group(1))] & _MASK
        elif base == "mov":
            regs[dest] = lane if ops[1] == "%laneid" else value(ops[1])
        elif base == "shfl":  # the DSL broadcasts the smem base from lane 0: the same value
            regs[dest] = value(ops[1])
        elif base in _BINARY:
            width = ((1 << 64) - 1) if ".wide" in op else _MASK
            regs[dest] = _BINARY[base](value(ops[1]), value(ops[2])) & width
        elif base == "mad":
            regs[dest] = (value(ops[1]) * value(ops[2]) + value(ops[3])) & _MASK
        elif base == "shr":
            a, b = value(ops[1]), value(ops[2])
            regs[dest] = (_signed(a) >> b) & _MASK if ".s32" in op else a >> b
        elif base == "setp":
            a, b = value(ops[1]), value(ops[2])
            cmp = op.split(".")[1]
            regs[dest] = {"eq": a == b, "ne": a != b, "lt": _signed(a) < _signed(b), "le": _signed(a) <= _signed(b),
                          "gt": _signed(a) > _signed(b), "ge": _signed(a) >= _signed(b)}[cmp]
        elif base == "selp":
            regs[dest] = value(ops[1]) if regs[ops[3]] else value(ops[2])
        else:
            raise NotImplementedError(f"probe PTX instruction not modelled: {line}")
    return addresses
