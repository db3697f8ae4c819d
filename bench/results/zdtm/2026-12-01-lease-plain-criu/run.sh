#!/bin/sh
# plain CRIU 4.1.1, no crabd, no runc: start a zdtm test (static binary from the bench cache) on the host,
# dump (tasks killed), restore, SIGTERM, verdict. Usage: run.sh file_lease02 (work dir /tmp/h15-lease/<test>)
S=/var/cache/crabd-zdtm/criu-4.1.1-f80a66cb3726/test/zdtm/static
T=$1; D=/tmp/h15-lease/$T; rm -rf $D; mkdir -p $D/img; cd $D
setsid $S/$T --pidfile=$D/t.pid --outfile=$D/t.out --filename=$D/t.test </dev/null >$D/launch.log 2>&1
P=$(cat t.pid)
timeout 60 criu dump -t $P -D img --file-locks -o dump.log --shell-job; echo "dump rc $?"
for i in $(seq 50); do [ -d /proc/$P ] || break; sleep 0.1; done
timeout 60 criu restore -D img --file-locks -o restore.log -v4 --shell-job -d; echo "restore rc $?"
sleep 0.3; kill -TERM $P; for i in $(seq 30); do [ -e t.out ] && break; sleep 0.1; done; tail -n 2 t.out
