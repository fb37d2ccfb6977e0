"""After a request's last step: the finisher thread (decode, check, write off the loop), the VAE team that
shares a decode across ranks, and the files, rows and records a result leaves. Imports kinds/ only."""
