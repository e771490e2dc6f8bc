"""The embedded etcd: where the user names no etcd, the job's agents run one themselves.

``layout`` (where members run and how everyone reaches them, pure), ``decisions`` (what an agent
does at start and when a member's node is gone, pure), ``cluster_api`` (member list, add, remove:
etcd's HTTP gateway), ``member`` (this node's etcd process), ``keeper`` (the agent's thread that
replaces dead members), ``service`` (what the command line calls). See docs/deploying.md.
"""
