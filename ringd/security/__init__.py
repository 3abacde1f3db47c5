"""The cluster secret's uses above the ring: signed HTTP requests, the cluster CA and TLS contexts (their labels are in wire/labels.py)."""
