"""Writing files the way asmem does (asmem/atomic_file.h): a temp file beside the target,
fsync, rename over it, fsync the directory. Shared by the tools/ scripts that write golden
and tokenizer data. (Unlike asmem's writer it leaves temp files of killed writers alone.)"""
import os


def write_atomic(path, text):
    """Writes `text` to a temp file beside `path`, fsyncs it, renames it over `path` and
    fsyncs the directory: an interrupted or failed write leaves the old file (or none), never
    a truncated one."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    dfd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
