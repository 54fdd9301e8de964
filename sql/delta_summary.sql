-- Quadrant counts of delta space and the boundary slope lambda: the 1st percentile of
-- d_cost / d_accept among rejected alternatives with d_accept > 0, in ms and in experts per
-- token of expected progress (plain-step alternatives, k = 0 < k*, have d_accept < 0 and do not
-- enter the slope). Reads the `deltas` table (the result of delta_space.sql).
SELECT
    count(*)                                               AS alternatives,
    count(*) FILTER (WHERE quadrant = 'I')                 AS quadrant_i,
    count(*) FILTER (WHERE quadrant = 'II')                AS quadrant_ii,
    count(*) FILTER (WHERE quadrant = 'III')               AS quadrant_iii,
    count(*) FILTER (WHERE quadrant = 'IV')                AS quadrant_iv,
    count(*) FILTER (WHERE quadrant = 'flat')              AS flat,
    quantile_cont(d_cost_ms / d_accept, 0.01) FILTER (WHERE d_accept > 0) AS lambda_ms,
    quantile_cont(d_experts / d_accept, 0.01) FILTER (WHERE d_accept > 0) AS lambda_experts,
    min(d_cost_ms / d_accept) FILTER (WHERE d_accept > 0)  AS min_slope_ms,
    median(d_cost_ms / d_accept) FILTER (WHERE d_accept > 0) AS median_slope_ms
FROM deltas;
