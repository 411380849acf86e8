"""Message sizes on the benchmarks' command lines ("4B,4KiB,1MiB") and in their output ("4 KiB")."""


def parse_size(s):
    s = s.strip().upper()
    for suffix, mult in (("KIB", 1 << 10), ("MIB", 1 << 20), ("B", 1)):
        if s.endswith(suffix):
            return int(s[: -len(suffix)]) * mult
    return int(s)


def label(nbytes):
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB" if nbytes >= 1 << 10 else f"{nbytes} B"
