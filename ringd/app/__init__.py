"""The entry points: `ringd serve` (the daemon), `ringd local`, `ringd demo`, the boot-time service, `ringctl` and ringd's command line."""
