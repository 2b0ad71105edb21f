"""What several tests share: starting processes cheaply (zygote) and a job of real ranks
(launch), the `ckpt` command (cli), the jobs of worker.py and what they leave behind (jobs),
elastic jobs (elastic), bitwise comparison (compare), the toy model, the model zoo, a node agent
process (agentd), a faulty S3 proxy (s3proxy) and S3 helpers (s3), a full disk (disk), hostile
pickles (pickles), a training loop (loop), writes (writes), the kill sweep (torture) and the
names the deployment files use (deploy_names)."""
