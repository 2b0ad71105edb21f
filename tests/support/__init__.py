"""What several tests share: starting a job of real ranks (launch), the jobs of worker.py and what
they leave behind (jobs), bitwise comparison (compare), the toy model, the model zoo, a faulty
S3 proxy, the kill sweep (torture) and the names the deployment files use (deploy_names)."""
