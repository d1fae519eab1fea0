"""Reads the TensorBoard event files in a log directory with TensorBoard's own code and prints
what it found as JSON, for tests/core/tensorboard_test.cpp.

Three independent views:
  - "events": every record, read by TensorBoard's TFRecord reader (which checks both CRCs and
    raises on a mismatch or a truncated record) and parsed by TensorBoard's Event protobuf;
    each record must re-serialize to exactly its bytes (no unknown or misencoded fields).
  - "scalars": what TensorBoard's EventAccumulator shows per tag, with its defaults (so with
    purge_orphaned_data: a SessionLog START drops the events read before it at its step or
    later).
  - "plugin_scalars": the same through the EventMultiplexer over the directory and its plugin
    accumulators, the Python backend behind the UI (`tensorboard --load_fast=false`), which
    keeps scalars as tensors and purges only on a run's second and later STARTs.
Both accumulators read a directory's event files in name order. Float values are also given
as their float32 bit patterns, so NaN and infinities compare.

usage: tensorboard_check.py LOGDIR
"""

import json
import pathlib
import struct
import sys

from tensorboard.backend.event_processing import event_accumulator, plugin_event_multiplexer
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.tensorflow_stub import errors
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import PyRecordReader_New
from tensorboard.util import tensor_util


def f32_bits(x):
    return struct.unpack("<I", struct.pack("<f", x))[0]


def json_float(x):
    return x if x == x and abs(x) != float("inf") else None


def read_records(path):
    reader = PyRecordReader_New(str(path))
    records = []
    while True:
        try:
            reader.GetNext()
        except errors.OutOfRangeError:
            return records  # clean end of file; a CRC error or truncation raises DataLossError
        records.append(reader.record())


def main():
    logdir = pathlib.Path(sys.argv[1])
    files = sorted(p for p in logdir.iterdir() if "tfevents" in p.name)
    out = {"files": [p.name for p in files], "events": [], "scalars": {}}
    for path in files:
        for raw in read_records(path):
            event = event_pb2.Event()
            event.ParseFromString(raw)
            assert event.SerializeToString() == raw, f"{path}: record does not round-trip"
            e = {"wall_time": event.wall_time, "step": event.step, "what": event.WhichOneof("what")}
            if e["what"] == "file_version":
                e["file_version"] = event.file_version
            elif e["what"] == "summary":
                e["values"] = [
                    {
                        "tag": v.tag,
                        "kind": v.WhichOneof("value"),
                        "value": json_float(v.simple_value),
                        "bits": f32_bits(v.simple_value),
                    }
                    for v in event.summary.value
                ]
            elif e["what"] == "session_log":
                e["status"] = event_pb2.SessionLog.SessionStatus.Name(event.session_log.status)
            e["file"] = path.name
            out["events"].append(e)

    acc = event_accumulator.EventAccumulator(
        str(logdir), size_guidance={event_accumulator.SCALARS: 0}
    )
    acc.Reload()
    out["file_version"] = acc.file_version
    for tag in acc.Tags()["scalars"]:
        out["scalars"][tag] = [
            {"step": s.step, "wall_time": s.wall_time, "bits": f32_bits(s.value)}
            for s in acc.Scalars(tag)
        ]

    mux = plugin_event_multiplexer.EventMultiplexer(
        size_guidance={plugin_event_multiplexer.event_accumulator.TENSORS: 0}
    )
    mux.AddRunsFromDirectory(str(logdir))
    mux.Reload()
    out["plugin_scalars"] = {}
    for run, tags in mux.Runs().items():
        assert run == ".", f"unexpected run {run!r}: the event files sit in LOGDIR itself"
        for tag in tags["tensors"]:
            out["plugin_scalars"][tag] = [
                {
                    "step": t.step,
                    "wall_time": t.wall_time,
                    "bits": f32_bits(tensor_util.make_ndarray(t.tensor_proto).item()),
                }
                for t in mux.Tensors(run, tag)
            ]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
