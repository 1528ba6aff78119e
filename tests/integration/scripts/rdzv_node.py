"""One rendezvous node, driven over stdin, for handler tests (no training).

    python rdzv_node.py ENDPOINT RUN_ID MIN MAX RDZV_CONF

Commands on stdin: ``join`` (next_rendezvous, prints a JSON line with rank, world size, round and
seconds taken), ``waiting`` (prints num_nodes_waiting), ``exit`` (normal exit: the node leaves).
"""

import json
import signal
import sys
import time

from torch.distributed.elastic.rendezvous import RendezvousParameters

from rendezvous.handler import create_handler


def main() -> None:
    # Like torchrun: SIGTERM becomes an exception, so the process exits normally (finalizers run).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    endpoint, run_id, low, high, conf = sys.argv[1:6]
    config = dict(item.split("=", 1) for item in conf.split(",") if item)
    handler = create_handler(
        RendezvousParameters("etcd-v3", endpoint, run_id, int(low), int(high), **config)
    )
    print(json.dumps({"ready": True, "node": getattr(handler, "node_id", None)}), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "join":
            started = time.monotonic()
            info = handler.next_rendezvous()
            print(
                json.dumps(
                    {
                        "rank": info.rank,
                        "world_size": info.world_size,
                        "round": getattr(handler, "_round", None),
                        "seconds": time.monotonic() - started,
                    }
                ),
                flush=True,
            )
        elif command == "waiting":
            print(json.dumps({"waiting": handler.num_nodes_waiting()}), flush=True)
        elif command == "exit":
            return


if __name__ == "__main__":
    main()
