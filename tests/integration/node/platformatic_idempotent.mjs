// Two idempotent @platformatic/kafka producers write N records each to
// partition 0 of a topic, one send per record; prints how many were acked.
// Usage: node platformatic_idempotent.mjs BOOTSTRAP TOPIC N
import { Producer, stringSerializers } from '@platformatic/kafka'

const [bootstrap, topic, n] = process.argv.slice(2)
const producers = ['a', 'b'].map(name => new Producer({
  clientId: `idem-${name}`, bootstrapBrokers: [bootstrap], serializers: stringSerializers,
  idempotent: true, acks: -1, autocreateTopics: false
}))
let acked = 0
await Promise.all(producers.map(async (p, i) => {
  for (let k = 0; k < Number(n); k++) {
    await p.send({ messages: [{ topic, partition: 0, key: `${i}`, value: `p${i}-${k}` }] })
    acked++
  }
}))
await Promise.all(producers.map(p => p.close()))
console.log(`acked ${acked}`)
