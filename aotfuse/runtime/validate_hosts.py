"""Load validation of allocs in another buffer's bytes (program version 8, Alloc.host, schedule/hosts.py),
for runtime/validate.py's instruction walk (`w`, its _Walk): a donated input is never used after the launch
or extern that follows its first hosted alloc; an output is hosted only before an instruction writes it, and
that instruction reads every buffer still in it (in place) and the next one frees them; buffers in one host
never overlap while both live. It checks memory safety, not what a kernel reads when."""
from __future__ import annotations

from ..contract.program import DONOR_VERSION
from ..dtypes import ITEMSIZE
from .validate_fields import KERNEL_PTR_ALIGN, _fail, _str


def _hosted(w, ins: dict, buf, off: int, nbytes: int, where: str) -> None:
    """An alloc in another buffer's bytes (version 8). The host is a program input (donated: never used after
    the launch or extern that follows its first hosted alloc) or a buffer allocated on its own that no
    instruction has written yet (an output: when one writes it, the buffers in its bytes must be read by that
    instruction, in place, and freed right after it). Buffers in one host never overlap while both live."""
    if w.prog["version"] < DONOR_VERSION:
        _fail(where, f"a version {w.prog['version']} program has no hosted allocs (version {DONOR_VERSION}+)")
    host = _str(ins["host"], f"{where}: host")
    if host not in w.host_bytes:
        d = w._use(host, f"{where}: host")
        if d.kind == "input":
            w.donated[host] = d.numel * ITEMSIZE[d.dtype]
            w.pending.add(host)  # the next launch or extern may still read it (in place), none after it
        elif d.kind != "alloc" or host not in w.own or host in w.hosted_live:
            _fail(where, f"host {host!r} is a {d.kind} buffer; only a program input or a buffer allocated on its "
                         "own may hold others")
        w.host_bytes[host] = d.numel * ITEMSIZE[d.dtype]
    if host in w.written:
        _fail(where, f"host {host!r} was written at instruction {w.written[host]}: its bytes are no longer idle")
    if off < 0 or off % KERNEL_PTR_ALIGN:
        _fail(where, f"offset {off} in host {host!r} is not a multiple of {KERNEL_PTR_ALIGN}")
    if off + nbytes > w.host_bytes[host]:
        _fail(where, f"bytes {off}..{off + nbytes} lie outside host {host!r} of {w.host_bytes[host]} bytes")
    for other, (hn, lo, hi) in w.hosted_live.items():
        if hn == host and off < hi and lo < off + nbytes:
            _fail(where, f"bytes {off}..{off + nbytes} of host {host!r} overlap live buffer {other!r} at {lo}..{hi}")
    w._define(ins["buf"], buf, where)
    w.hosted_live[ins["buf"]] = (host, off, off + nbytes)


def _writes_reads(w, ins: dict) -> tuple[list, set]:
    """The buffers a (validated) launch or extern writes, and those it reads."""
    if ins["op"] == "launch":
        specs = w.kernels[ins["kernel"]]["args"]
        pairs = list(zip(ins["args"], specs))
        return [b for b, a in pairs if a["role"] == "out"], {b for b, a in pairs if a["role"] != "out"}
    reads = set()

    def walk(a):
        if type(a) is dict and "t" in a:
            reads.add(a["t"])
        elif type(a) is list:
            for x in a:
                walk(x)
    walk(ins["args"])
    walk(list(ins["kwargs"].values()))
    return ([ins["out"]] if ins.get("out_variant") else []), reads


def _host_writes(w, i: int, ins: dict, where: str) -> None:
    """After a launch or extern: a host it writes is written from now on; buffers still in its bytes must be
    read by this instruction (in place) and freed by the next one."""
    writes, reads = _writes_reads(w, ins)
    for b in writes:
        if b not in w.host_bytes or b in w.donated:
            continue
        tenants = {t for t, (h, _, _) in w.hosted_live.items() if h == b}
        if tenants - reads:
            _fail(where, f"writes host {b!r} while {sorted(tenants - reads)[0]!r} lies in its bytes")
        w.must_free |= tenants
        w.written.setdefault(b, i)
