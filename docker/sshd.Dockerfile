# hvdp's image plus an sshd that runs as its non-root user, for the Kubeflow MPI Operator's MPIJob
# (kubeflow.org/v2beta1; docs/launchers.md#kubernetes-the-mpi-operator). Build the image first, then this:
#
#   docker build -t hvdp .
#   docker build -t registry.example.com/hvdp:cpu-sshd --build-arg BASE=hvdp -f docker/sshd.Dockerfile docker/
#
# The operator mounts the job's generated keys (id_rsa, id_rsa.pub, authorized_keys) at the MPIJob's
# sshAuthMountPath: /home/app/.ssh here, the home of the image's user `app` (uid 1000), instead of its
# default /root/.ssh. The workers run `/usr/sbin/sshd -De -f /home/app/.sshd_config`: port 2222 (a non-root
# user cannot bind 22), the mounted private key as host key, and no ownership checks of the read-only mount
# (StrictModes no). The launcher's mpirun reaches them with ssh on that port, asking about no host keys.
# The same recipe as the operator's own base image (build/base/ of kubeflow/mpi-operator), on hvdp's.
ARG BASE=hvdp
FROM ${BASE}
USER root
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends openssh-server \
    && rm -rf /var/lib/apt/lists/* \
    && printf 'Host *\n    Port 2222\n    StrictHostKeyChecking no\n    UserKnownHostsFile /dev/null\n    LogLevel ERROR\n' \
        >> /etc/ssh/ssh_config \
    && printf 'Port 2222\nPidFile /home/app/sshd.pid\nHostKey /home/app/.ssh/id_rsa\nStrictModes no\nUsePAM no\n' \
        > /home/app/.sshd_config \
    && chown app:app /home/app/.sshd_config
USER app
