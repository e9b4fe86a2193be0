"""gcp-storage-emulator, started like its own command (`python gcs_emulator.py start --host H --port P --in-memory`),
with two fixes: a multipart upload keeps its file's bytes exactly, and connections queue instead of being dropped.

The emulator reads a multipart upload (gcsfs sends every file under 5 MiB as one) with Python's email parser, which
takes the line break before a boundary to be CRLF when it can. gcsfs ends each part with LF alone, so a file whose last
byte is CR lost that byte. Orbax's binary files (OCDBT data files, manifests) end in CR now and then (5 step folders
in 331 seen), so now and then the copy of the step a run resumed from was short, and the resume fell back to an older
step. Here each LF before a boundary becomes CRLF, as RFC 2046 writes it."""
import http.server
import sys

from gcp_storage_emulator import server
from gcp_storage_emulator.__main__ import main

_read_raw_data = server._read_raw_data


def read_raw_data(handler) -> bytes | None:
    raw = _read_raw_data(handler)
    content_type = handler.headers.get("Content-Type") or ""
    if raw and content_type.startswith("multipart/related") and "boundary=" in content_type:
        delimiter = b"--" + content_type.split("boundary=", 1)[1].split(";")[0].strip().strip('"').encode()
        if raw.startswith(delimiter + b"\n"):  # LF line breaks, as gcsfs writes them
            raw = raw.replace(b"\n" + delimiter, b"\r\n" + delimiter)
    return raw


server._read_raw_data = read_raw_data

# The emulator answers one request at a time (http.server.HTTPServer) and listens with a queue of 5 connections.
# gcsfs puts a step's files at once, a connection each (33 for the tests' small model): the connections past the
# queue were dropped, and the client sent them again after TCP's back-off (1, 3, 7, 15, 31 s), both sides idle. A
# run resumed from a copy waited 30-60 s for its last copy (a 12-step run: 45-70 s where it trained for 8 s).
http.server.HTTPServer.request_queue_size = 256

if __name__ == "__main__":
    main(sys.argv[1:])
