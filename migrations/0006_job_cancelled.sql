-- Jobs can be cancelled by a client (DELETE /v1/jobs/{id}).
ALTER TABLE jobs DROP CONSTRAINT IF EXISTS jobs_state_check;
ALTER TABLE jobs ADD CONSTRAINT jobs_state_check
    CHECK (state IN ('queued', 'running', 'succeeded', 'failed', 'cancelled'));
