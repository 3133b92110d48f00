#!/bin/sh
# preStop hook of a Ray worker pod: drain the node, wait while Serve moves its work, then stop Ray.
#
#   drain-node.sh DEADLINE_S      (DEADLINE_S below the pod's terminationGracePeriodSeconds)
#
# `ray stop` alone (KubeRay's sample hook) kills the node's replicas at once and cuts the streams
# they serve. Draining first (the API Ray's autoscaler calls before it removes a node) makes Serve
# start each replica's replacement on another node and then stop the old one gracefully: a Router
# replica finishes the requests it holds (up to SPECDEC_ROUTER_DRAIN_S), a Target replica ends its
# round (the lanes re-prefill on the new one), and the node's proxy drains its connections. Serve
# stops a replica whose replacement has not started by DEADLINE_S minus its graceful timeout.
# This script waits until no Serve process is left on the node, or DEADLINE_S, then stops Ray.
# If the drain request fails (no cluster found, GCS unreachable: `--address auto` never starts a
# Ray instance of its own to drain), it stops Ray at once, as before. When the whole cluster goes
# (an upgrade deletes the old one, head included), the node's raylet exits once the GCS is gone,
# its replicas with it, and the wait ends then.
#
# SPECDEC_DRAIN_PROCESSES: what "Serve still works here" means, an extended regex matched against
# /proc/PID/cmdline (Ray sets the process title of an actor's worker to `ray::<actor class>`).
# SPECDEC_DRAIN_POLL_S: seconds between checks.
# SPECDEC_DRAIN_LOG: where the hook writes what it does (a preStop hook's own output is dropped);
# default the container's log, the stdout of its PID 1.
set -u
deadline_s=${1:?usage: drain-node.sh DEADLINE_S}
log=${SPECDEC_DRAIN_LOG:-/proc/1/fd/1}
if (: >>"$log") 2>/dev/null; then exec >>"$log" 2>&1; fi
pattern=${SPECDEC_DRAIN_PROCESSES:-'^ray::(ServeReplica|ProxyActor)'}
poll_s=${SPECDEC_DRAIN_POLL_S:-2}

serve_still_works() {
    grep -q -s -a -E "$pattern" /proc/[0-9]*/cmdline
}

if timeout 60 ray drain-node --address auto --reason DRAIN_NODE_REASON_PREEMPTION \
        --reason-message "pod terminating (preStop hook)" --deadline-remaining-seconds "$deadline_s"; then
    end=$(( $(date +%s) + deadline_s ))  # (after the call: the GCS counts from its arrival)
    echo "drain-node: node draining; waiting up to ${deadline_s}s for Serve to move its replicas"
    while serve_still_works && [ "$(date +%s)" -lt "$end" ]; do
        sleep "$poll_s"
    done
    if serve_still_works; then echo "drain-node: deadline reached; stopping Ray"; else echo "drain-node: Serve left the node; stopping Ray"; fi
else
    echo "drain-node: the drain request failed; stopping Ray now" >&2
fi
exec ray stop
