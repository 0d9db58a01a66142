"""The ragline application: the `ragline` command, `ragline up`, ingest, local launchers
(etcd, Triton) and datasets. It sits above the services and finds them through
`ragline_services.registry`; nothing below imports it."""
