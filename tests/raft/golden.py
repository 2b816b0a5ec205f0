"""A tiny script language over the simulated cluster, for golden scenario tests.

One command per line; ``#`` starts a comment. Every command echoes itself (``> cmd``) and
prints what it observed, so a script with its output reads as a protocol transcript.

    cluster voters=3 observers=0 seed=1   start a fault-free cluster
    run 200                               run 200 simulated ms
    run-until leader [timeout_ms]         run until some node leads
    run-until committed [timeout_ms]      run until the last proposal is committed
    run-until caught-up [timeout_ms]      run until every node holds the leader's log and HW
    run-until role N ROLE [timeout_ms]    run until node N is in ROLE (e.g. prospective)
    propose-on N rec...                   propose records on node N (prints the outcome)
    partition 1,2 | 3                     cut both directions between two groups
    isolate N / heal                      cut N off from everyone / undo every cut
    crash N / restart N / shutdown N      power loss / start again / graceful stop
    begin-shutdown N                      graceful stop begun (resign), node N keeps running
    status                                role, epoch, leader, high watermark, log end per node
    log N                                 node N's batches
    messages on|off                       print every delivered message
"""

from __future__ import annotations

from raft.node import NotLeaderError, Proposal, ProposalRejectedError
from tests.sim.cluster import Cluster, batches_text


class ScriptError(ValueError):
    """A line the script language does not understand."""


def run_script(text: str) -> str:
    out: list[str] = []
    cluster: Cluster | None = None
    last: Proposal | None = None
    show_messages = False

    def trace(line: str) -> None:
        if show_messages:
            out.append("  " + line.strip())

    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        out.append(f"> {line}")
        words = line.split()
        command, args = words[0], words[1:]
        if command == "cluster":
            options = dict(word.split("=", 1) for word in args)
            cluster = Cluster(int(options.get("seed", "1")), int(options.get("voters", "3")),
                              int(options.get("observers", "0")), trace=trace)
            continue
        if cluster is None:
            raise ScriptError(f"{line!r}: start with 'cluster'")
        if command == "run":
            cluster.run_for(int(args[0]))
            out.append(f"  t={cluster.now_ms}")
        elif command == "run-until":
            timeout_ms = int(args[1]) if len(args) > 1 else 5_000
            if args[0] == "leader":
                ok = cluster.run_until(lambda c=cluster: c.leader() is not None, timeout_ms)
            elif args[0] == "committed":
                proposal = last
                ok = proposal is not None and cluster.run_until(
                    lambda c=cluster, p=proposal: c.is_committed(p), timeout_ms)
            elif args[0] == "role":
                node_id, role = int(args[1]), args[2]
                timeout_ms = int(args[3]) if len(args) > 3 else 5_000
                def in_role(c: Cluster = cluster, n: int = node_id, r: str = role) -> bool:
                    core = c.nodes[n].core
                    return core is not None and core.role.value == r
                ok = cluster.run_until(in_role, timeout_ms)
            elif args[0] == "caught-up":
                def caught_up(c: Cluster = cluster) -> bool:
                    leader = c.leader()
                    return leader is not None and all(
                        n.core is not None and n.core.high_watermark >= leader.core.high_watermark  # type: ignore[union-attr]
                        and n.log.end_offset() == leader.log.end_offset() for n in c.nodes.values())
                ok = cluster.run_until(caught_up, timeout_ms)
            else:
                raise ScriptError(f"{line!r}: run-until leader|committed|caught-up|role")
            out.append(f"  {'ok' if ok else 'timed out'} t={cluster.now_ms}")
        elif command == "propose-on":
            node = cluster.nodes[int(args[0])]
            assert node.core is not None
            try:
                last = node.core.propose(cluster.now_ms, [r.encode() for r in args[1:]])
                out.append(f"  accepted epoch={last.epoch} offsets={last.base_offset}..{last.last_offset}")
            except NotLeaderError as exc:
                out.append(f"  NotLeaderError leader={exc.leader_id}")
            except ProposalRejectedError as exc:
                out.append(f"  ProposalRejectedError {exc}")
            cluster.after_input(node)
        elif command == "partition":
            text_groups = " ".join(args).split("|")
            groups = [{int(x) for x in group.replace(",", " ").split()} for group in text_groups]
            cluster.partition(groups[0], groups[1])
        elif command == "isolate":
            victim = int(args[0])
            cluster.partition({victim}, set(cluster.nodes) - {victim})
        elif command == "heal":
            cluster.heal()
        elif command in ("crash", "restart", "shutdown", "begin-shutdown"):
            getattr(cluster, command.replace("-", "_"))(int(args[0]))
        elif command == "status":
            for node in cluster.nodes.values():
                core = node.core
                if core is None:
                    out.append(f"  node {node.node_id}: down")
                    continue
                out.append(f"  node {node.node_id}: {core.role.value:<11} epoch={core.epoch} leader={core.leader_id} "
                           f"hw={core.high_watermark} end={node.log.end_offset()}")
        elif command == "log":
            node = cluster.nodes[int(args[0])]
            out.append("  " + (batches_text(node.log.read(node.log.start_offset(), 1 << 30)) or "(empty)"))
        elif command == "messages":
            show_messages = args[0] == "on"
        else:
            raise ScriptError(f"{line!r}: unknown command")
    return "\n".join(out) + "\n"
