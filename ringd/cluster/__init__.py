"""Who is here and who leads: links and heartbeats, discovery, election and reconciliation (sans-I/O), placement, the coordinator and the stage host."""
