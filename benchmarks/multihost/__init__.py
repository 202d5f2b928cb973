"""Across machines, as root (hosts are Linux network namespaces with a real agent each): recovery, and
`monarch-plugin doctor`'s time."""
