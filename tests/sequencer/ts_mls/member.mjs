// MLS members from ts-mls for the sequencer tests: JSON lines on stdin, one answer line each on
// stdout. Bytes travel as hex. Each member is named; its state lives in this process.
import * as readline from "node:readline"
import {
  createCommit, createGroup, joinGroup, processMessage, getCiphersuiteImpl, getCiphersuiteFromName,
  defaultCapabilities, defaultLifetime, emptyPskIndex, generateKeyPackage, encodeMlsMessage,
  decodeMlsMessage, mlsExporter, acceptAll,
} from "ts-mls"

const impl = await getCiphersuiteImpl(getCiphersuiteFromName("MLS_128_DHKEMX25519_AES128GCM_SHA256_Ed25519"))
const hex = (b) => Buffer.from(b).toString("hex")
const bytes = (h) => new Uint8Array(Buffer.from(h, "hex"))
const members = new Map()     // name -> { kp, state, pending }
const keyPackages = new Map() // name -> { publicPackage, privatePackage }

function decode(h) {
  const d = decodeMlsMessage(bytes(h), 0)
  if (!d) throw new Error("undecodable MLSMessage")
  return d[0]
}

async function status(m) {
  const secret = await mlsExporter(m.state.keySchedule.exporterSecret, "sequencer-test", new Uint8Array(0), 32, impl)
  return { epoch: Number(m.state.groupContext.epoch), secret: hex(secret) }
}

const ops = {
  async key_package({ name }) {
    const cred = { credentialType: "basic", identity: new TextEncoder().encode(name) }
    const kp = await generateKeyPackage(cred, defaultCapabilities(), defaultLifetime, [], impl)
    keyPackages.set(name, kp)
    return { kp: hex(encodeMlsMessage({ keyPackage: kp.publicPackage, wireformat: "mls_key_package", version: "mls10" })) }
  },
  async create({ name, gid }) {
    const kp = keyPackages.get(name) ?? (await ops.key_package({ name }), keyPackages.get(name))
    members.set(name, { state: await createGroup(bytes(gid), kp.publicPackage, kp.privatePackage, [], impl), pending: null })
    return status(members.get(name))
  },
  async add({ name, kps }) {
    // the founding Commit: add members, merged at once, a Welcome carrying the ratchet tree
    const m = members.get(name)
    const extraProposals = kps.map((k) => ({ proposalType: "add", add: { keyPackage: decode(k).keyPackage } }))
    const r = await createCommit({ state: m.state, cipherSuite: impl }, { extraProposals, ratchetTreeExtension: true })
    m.state = r.newState
    const welcome = encodeMlsMessage({ welcome: r.welcome, wireformat: "mls_welcome", version: "mls10" })
    return { commit: hex(encodeMlsMessage(r.commit)), welcome: hex(welcome), ...(await status(m)) }
  },
  async join({ name, welcome }) {
    const kp = keyPackages.get(name)
    const state = await joinGroup(decode(welcome).welcome, kp.publicPackage, kp.privatePackage, emptyPskIndex, impl)
    members.set(name, { state, pending: null })
    return status(members.get(name))
  },
  async commit({ name }) {
    // a Commit for the current epoch (an UpdatePath, no proposals), held until the sequencer answers
    const m = members.get(name)
    const r = await createCommit({ state: m.state, cipherSuite: impl }, {})
    m.pending = r.newState
    return { commit: hex(encodeMlsMessage(r.commit)) }
  },
  async accepted({ name }) {
    const m = members.get(name)
    m.state = m.pending
    m.pending = null
    return status(m)
  },
  async rejected({ name }) {
    members.get(name).pending = null
    return status(members.get(name))
  },
  async process({ name, msg }) {
    const m = members.get(name)
    const r = await processMessage(decode(msg), m.state, emptyPskIndex, acceptAll, impl)
    m.state = r.newState
    return status(m)
  },
  async status({ name }) {
    return status(members.get(name))
  },
}

const rl = readline.createInterface({ input: process.stdin })
for await (const line of rl) {
  let answer
  try {
    const req = JSON.parse(line)
    answer = { ok: true, ...(await ops[req.op](req)) }
  } catch (e) {
    answer = { ok: false, error: String(e && e.stack || e) }
  }
  process.stdout.write(JSON.stringify(answer) + "\n")
}
