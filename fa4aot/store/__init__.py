"""The versioned on-disk store: `layers` (roots and stores), `records`, `toolchain`, `files`,
`locking`; and what moves stores around: archive, wheel, merge, prune; the runtime library,
the miss log, `doctor`."""
